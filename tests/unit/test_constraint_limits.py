"""The bounds on clients' schemas and grammars (server.constrained.limits) and the compile
children (server.constrained.worker): exact depths, the limit each error names, a child that
dies or overruns replaced, failures remembered."""

from __future__ import annotations

import pytest

from server.constrained import ConstraintError, gbnf_constraint, json_schema_constraint, worker
from server.constrained.limits import (
    ConstraintLimits,
    check_grammar_shape,
    check_schema_shape,
    enum_entries,
    gbnf_depth,
    schema_depth,
)


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    lines = [f'r{n} ::= "end"'] + [f'r{i} ::= "x" r{i + 1}' for i in range(n - 1, -1, -1)]
    return "\n".join([*lines, "root ::= r0"])


@pytest.fixture
def limits():
    """Restores the default limits (and a fresh pool) after a test that changes them."""
    yield
    worker.configure(ConstraintLimits())


# ---- shapes -----------------------------------------------------------------------------


def test_schema_depth_counts_nesting_and_ref_hops_exactly():
    assert schema_depth({"type": "string"}, 100) == 1
    assert schema_depth({"properties": {"a": {"type": "string"}}}, 100) == 3
    # root -> $defs map -> d0 -> (ref) d1 -> ... -> d_n: n + 1 definitions below the map
    assert schema_depth(ref_chain(10), 1000) == 13
    assert schema_depth(ref_chain(100), 1000) == 103


def test_schema_depth_stops_early_past_the_limit():
    assert schema_depth(ref_chain(100_000), 50) == 51


def test_cycles_are_cut_where_they_close():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    assert schema_depth(tree, 100) == 6  # root, $defs, node, properties, kids, items
    assert schema_depth({"$ref": "#"}, 100) == 1


def test_refs_by_id_and_anchor_are_followed():
    n = 30
    defs = {f"a{i}": {"$id": f"urn:a{i}", "$ref": f"urn:a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"$id": f"urn:a{n}", "$anchor": "end", "type": "integer"}
    defs["start"] = {"$ref": "#end"}
    schema = {"$defs": defs, "$ref": "urn:a0"}
    assert schema_depth(schema, 1000) == n + 3  # root, $defs, a0 ... a_n
    assert (
        schema_depth({"$defs": {"x": {"$anchor": "x", "type": "string"}}, "$ref": "#x"}, 100) == 3
    )


def test_a_finished_subschema_reached_deeper_still_counts():
    """Memoized depths are added to the path that reaches them again."""
    shared = {"properties": {"a": {"properties": {"b": {"type": "string"}}}}}  # depth 5
    schema = {"anyOf": [shared, {"items": {"items": {"items": shared}}}]}
    assert schema_depth(schema, 100) == 2 + 3 + 5


def test_enum_entries_are_counted_across_subschemas():
    schema = {
        "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": ["x"], "default": "x"}},
        "anyOf": [{"enum": [[1, 2], {"enum": [9] * 50}]}],
    }
    assert enum_entries(schema) == 6  # an enum's values are data: not walked


def test_gbnf_depth_follows_rule_chains_and_parentheses():
    assert gbnf_depth(rule_chain(10), 1000) == 12
    assert gbnf_depth('root ::= "a" | "(" root ")"  # comment r0 r1\n', 100) == 1
    assert gbnf_depth("root ::= " + "(" * 40 + '"a"' + ")" * 40, 100) == 40
    assert gbnf_depth('root ::= x\nx ::= [a-z()]{1,3} "::= y" y\ny ::= "b"', 100) == 3


def test_shape_errors_name_the_flag():
    lim = ConstraintLimits(max_depth=50, max_enum=10)
    with pytest.raises(ValueError, match="--constraint-max-depth"):
        check_schema_shape(ref_chain(60), lim)
    with pytest.raises(ValueError, match="--constraint-max-enum"):
        check_schema_shape({"enum": list(range(11))}, lim)
    with pytest.raises(ValueError, match="--constraint-max-depth"):
        check_grammar_shape(rule_chain(60), lim)
    check_schema_shape(ref_chain(40), lim)
    check_grammar_shape(rule_chain(40), lim)


def test_constraint_errors_name_limits_before_any_compile(limits):
    worker.configure(ConstraintLimits(max_depth=64, max_bytes=2000))
    runs = worker.pool().n_runs
    with pytest.raises(ConstraintError, match="--constraint-max-depth"):
        json_schema_constraint(ref_chain(100))
    with pytest.raises(ConstraintError, match="--constraint-max-bytes"):
        json_schema_constraint({"enum": ["x" * 3000]})
    with pytest.raises(ConstraintError, match="--constraint-max-depth"):
        gbnf_constraint(rule_chain(100))
    assert worker.pool().n_runs == runs  # nothing reached a compiler


# ---- the compile children -------------------------------------------------------------


def test_a_crashing_body_costs_a_child_and_is_remembered(limits):
    """A $ref chain of 5,000 links overflows llguidance's stack: in a child, which dies."""
    worker.configure(ConstraintLimits(max_depth=10**6, max_bytes=10**8, workers=1))
    pool = worker.pool()
    with pytest.raises(ConstraintError, match="the compiler failed on it"):
        json_schema_constraint(ref_chain(5000))
    assert pool.n_crashed == 1
    runs = pool.n_runs
    with pytest.raises(ConstraintError, match="the compiler failed on it"):
        json_schema_constraint(ref_chain(5000))
    assert pool.n_runs == runs  # the failure is remembered: no child runs it again
    assert json_schema_constraint({"type": "integer", "minimum": 3}).kind == "json_schema"
    assert pool.n_crashed == 1


def test_an_overrunning_compile_is_cut_at_its_cpu_time(limits):
    """A 60,000-entry enum takes about half a second to compile; with the enum bound lifted
    and 50 ms of CPU time allowed, its child is killed and the request gets a 400."""
    worker.configure(ConstraintLimits(timeout=0.05, workers=1, max_enum=10**6, max_bytes=10**8))
    pool = worker.pool()
    assert pool.run({"op": "ping"}) == {"pong": True}
    with pytest.raises(ConstraintError, match="--constraint-timeout"):
        json_schema_constraint({"enum": [f"value-{i}" for i in range(60000)]})
    assert pool.n_timed_out == 1
    assert pool.run({"op": "ping"}) == {"pong": True}  # a new child took its place
