"""Workload 17 (issue 42): images, side by side with llama-server on the same projector.

The runner is bench/images.py; this module only declares the workload (its sizes, metrics,
configurations and ratios). It builds on bench/workloads.py's types and is imported by that
module after them (at its end), so import bench.workloads, not this module, first.
"""

from __future__ import annotations

from .images import (
    LLAMA_LOG,
    LLAMA_MM,
    LLAMA_TOY,
    LOG_SUFFIX,
    MM_FLAGS,
    MM_SUFFIX,
    OURS_LOG,
    OURS_MM,
    OURS_MM_FLAGS,
    OURS_TOY,
    TOY,
    TOY_FLAGS,
    TOY_SUFFIX,
    ImageShape,
    ensure_projector,
    run_images,
)
from .servers import ServerProcess
from .workloads import QUICK, Ctx, Metric, Sample, Sizes, Variant, VariantRatio, Workload

FULL_SHAPE = ImageShape(
    convs=6, system=1000, follow_ups=4, questions=16, concurrency=4, out=16, words=20
)
QUICK_SHAPE = ImageShape(
    convs=5, system=600, follow_ups=2, questions=8, concurrency=4, out=8, words=12
)

# llama-server logs the lines that bracket an encode at verbosity 4 (libraries' INFO is
# its TRACE: bench/images.py's llama_encodes); ours takes its encode time from /metrics and
# keeps its own level 3 (the later flag wins).
_LLAMA_LOG = ("-lv", "4")
_OURS_LOG = ("-lv", "3")


def shape_of(sizes: Sizes) -> ImageShape:
    return QUICK_SHAPE if sizes == QUICK else FULL_SHAPE


async def w17_images(ctx: Ctx, srv: ServerProcess, rep: int) -> Sample:
    metrics, ttft = await run_images(ctx.client, srv, ctx.book, f"w17-r{rep}", shape_of(ctx.sizes))
    return Sample(metrics=metrics, ttft_ms=ttft)


def _describe(sizes: Sizes) -> str:
    s = shape_of(sizes)
    return (
        f"a random `gemma3` projector for the default model (bench/images.py: 224-pixel "
        f"images, 64 tokens each) with a vision tower of SigLIP-B's size (12 blocks of width "
        f"768, the smallest real models ship), sent photo-like 1024x768 PNGs (~1.6 MB); "
        f"both servers `--mmproj` on the same file (the "
        f"-mm configurations, ours with `--metrics`; the same again as -mm-lv4 with "
        f"llama-server at `-lv 4`, whose log times its encodes: encode times come from "
        f"-mm-lv4, everything else from -mm, as llama-server answers ~10 % slower at that "
        f"verbosity; and as -mm-toy, the workload as first measured: a toy tower of 4 "
        f"blocks of width 256, ~30 ms an encode, sent 256-pixel noise PNGs); "
        f"`/completion` with `multimodal_data`, Gemma turn markup. (a) {s.convs} conversations, "
        f"each a ~{s.system}-token system prompt, its own image and a question, then "
        f"{s.follow_ups} follow-up turns re-sending the image, round-robin one request at a "
        f"time over 4 slots; (b) {s.questions} questions about one image under another "
        f"~{s.system}-token system prompt, {s.concurrency} in flight; {s.out} tokens per answer. "
        f"Encode time as each server reports it (ours /metrics, llama-server's log timestamps)"
    )


W17 = Workload(
    17,
    "Images: conversations about a picture, 16 questions about one picture",
    _describe,
    (
        Metric("conv_ttft_turn1_ms", "(a) turn-1 TTFT p50", "ms", False, chart=False),
        Metric("conv_ttft_later_ms", "(a) turn-2+ TTFT p50", "ms", False),
        Metric("conv_prompt_later", "(a) turn-2+ prompt tokens computed", "tok", False),
        Metric("conv_encode_ms", "(a) encode time", "ms", False, chart=False),
        Metric("q16_wall_s", "(b) wall time", "s", False),
        Metric("q16_ttft_p50_ms", "(b) TTFT p50", "ms", False),
        Metric("q16_prompt", "(b) prompt tokens computed", "tok", False, chart=False),
        Metric("q16_encode_ms", "(b) encode time", "ms", False, chart=False),
        Metric("encode_ms", "total encode time, (a) + (b)", "ms", False),
        Metric("encoded", "images encoded", "", False, chart=False),
        Metric("encode_ms_each", "mean time of one encode", "ms", False, chart=False),
    ),
    w17_images,
    variants=(
        Variant(MM_SUFFIX, MM_FLAGS, OURS_MM_FLAGS),
        Variant(LOG_SUFFIX, (*MM_FLAGS, *_LLAMA_LOG), (*OURS_MM_FLAGS, *_OURS_LOG)),
        Variant(TOY_SUFFIX, TOY_FLAGS, OURS_MM_FLAGS),
    ),
    # ours / llama-server (the target: at most 0.5x on both), then llama-server / ours
    # with the target as a factor (a VariantRatio's target is a floor)
    variant_ratios=(
        VariantRatio(OURS_MM, LLAMA_MM, "conv_ttft_later_ms"),
        VariantRatio(OURS_LOG, LLAMA_LOG, "encode_ms"),
        VariantRatio(LLAMA_MM, OURS_MM, "conv_ttft_later_ms", 2.0),
        VariantRatio(LLAMA_LOG, OURS_LOG, "encode_ms", 2.0),
        VariantRatio(OURS_MM, LLAMA_MM, "q16_wall_s"),
        VariantRatio(OURS_TOY, LLAMA_TOY, "conv_ttft_later_ms"),
    ),
    variants_only=True,
)

# the configurations' --mmproj files must exist before they start
ensure_projector()
ensure_projector(TOY)
