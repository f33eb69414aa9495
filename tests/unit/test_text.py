from server.slot.text import TextStream


def feed(stream, pieces):
    out, stop = [], ""
    for p in pieces:
        r = stream.push(p.encode() if isinstance(p, str) else p)
        out.append(r.text)
        if r.stop:
            stop = r.stop
            break
    return out, stop


def test_no_stops_passes_through():
    s = TextStream([])
    assert feed(s, ["ab", "c"]) == (["ab", "c"], "")


def test_partial_stop_is_held_then_released():
    s = TextStream(["END"])
    out, stop = feed(s, ["hello E", "N", "x"])
    assert out == ["hello ", "", "ENx"] and stop == ""


def test_stop_across_pieces_is_never_leaked():
    s = TextStream(["END"])
    out, stop = feed(s, ["hello E", "ND and more"])
    assert "".join(out) == "hello " and stop == "END"


def test_earliest_stop_wins():
    s = TextStream(["b", "a"])
    out, stop = feed(s, ["xab"])
    assert out == ["x"] and stop == "a"


def test_flush_returns_held_text():
    s = TextStream(["ENDING"])
    out, _ = feed(s, ["foo EN"])
    assert out == ["foo "]
    assert s.flush() == "EN"


def test_utf8_split_across_tokens():
    s = TextStream([])
    data = "é".encode()
    assert s.push(data[:1]).text == ""
    assert s.push(data[1:]).text == "é"


def test_feed_agrees_with_the_decoder_around_split_characters():
    # ``feed`` takes ASCII pieces without the incremental decoder only when nothing waits in
    # it: a split character followed by ASCII, and an invalid byte, come out as the decoder's
    s = TextStream([])
    data = "é".encode()
    pieces = [b"ab", data[:1], data[1:] + b"c", data[:1], b"x", b"\xff", b"y"]
    assert [s.feed(p) for p in pieces] == ["ab", "", "éc", "", "\ufffdx", "\ufffd", "y"]
    assert s.flush() == ""
