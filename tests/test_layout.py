"""Bucket layout: pure arithmetic, no processes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fgpsdp_runtime.layout import (SLICE_ALIGN_BYTES, ParamInfo, default_bucket_cap_mb, owned_numel,
                                   param_alignment_for, plan_buckets)


def fp32(n):
    return ParamInfo(n, "float32", 4)


def check_layout(infos, layouts, world):
    owners = {}  # (param, element) -> owning rank
    for layout in layouts:
        assert layout.padded_numel % world == 0
        align = max(1, SLICE_ALIGN_BYTES // layout.element_size)
        assert layout.shard_numel % align == 0
        # Minimal padding: less than one aligned element per rank.
        assert 0 <= layout.padded_numel - layout.numel < world * align
        sizes = {layout.shard_range(r)[1] - layout.shard_range(r)[0] for r in range(world)}
        assert sizes == {layout.shard_numel}
        for rank in range(world):
            for piece in layout.shard_pieces(rank):
                for e in range(piece.param_offset, piece.param_offset + piece.numel):
                    key = (piece.param_index, e)
                    assert key not in owners, f"element {key} owned twice"
                    owners[key] = rank
    expected = {(i, e) for i, info in enumerate(infos) for e in range(info.numel)}
    assert set(owners) == expected, "every element owned exactly once"
    assert sum(owned_numel(layouts, r) for r in range(world)) == sum(i.numel for i in infos)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
       world=st.integers(1, 7), cap=st.integers(4, 2000))
def test_every_element_owned_once(sizes, world, cap):
    infos = [fp32(n) for n in sizes]
    layouts = plan_buckets(infos, bucket_cap_bytes=cap, world_size=world)
    check_layout(infos, layouts, world)
    for layout in layouts[:-1]:  # a bucket closes once it reaches the cap, not before
        param_bytes = sum(s.numel for s in layout.spans) * 4  # the alignment gaps aside
        assert param_bytes - layout.spans[-1].numel * 4 < cap <= param_bytes


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 200), st.sampled_from(["f32", "bf16"])),
                      min_size=1, max_size=10), world=st.integers(1, 5))
def test_one_dtype_per_bucket(sizes, world):
    infos = [fp32(n) if d == "f32" else ParamInfo(n, "bfloat16", 2) for n, d in sizes]
    layouts = plan_buckets(infos, bucket_cap_bytes=400, world_size=world)
    check_layout(infos, layouts, world)
    for layout in layouts:
        assert {infos[s.param_index].dtype_name for s in layout.spans} == {layout.dtype_name}


def test_balanced_with_one_large_tensor():
    # One 512x1000 Linear beside six 8x8 Linears, 4 ranks, registration order.
    infos = [fp32(512 * 1000), fp32(512)] + [fp32(n) for _ in range(6) for n in (64, 8)]
    world = 4
    layouts = plan_buckets(infos, bucket_cap_bytes=25 * 2**20, world_size=world)
    owned = [owned_numel(layouts, r) for r in range(world)]
    assert sum(owned) == sum(i.numel for i in infos)
    assert max(owned) / min(owned) <= 1.02


def test_balanced_with_small_buckets_too():
    infos = [fp32(512 * 1000), fp32(512)] + [fp32(n) for _ in range(6) for n in (64, 8)]
    layouts = plan_buckets(infos, bucket_cap_bytes=2**16, world_size=4)
    owned = [owned_numel(layouts, r) for r in range(4)]
    assert max(owned) / min(owned) <= 1.02


def test_weight_takes_its_bias_along():
    # Three Linear layers whose weights reach the cap: each bias (ready just
    # before its weight in backward) joins the weight's bucket instead of
    # becoming a bucket of 16 bytes that costs a collective of its own.
    for weight in (100, 1000):  # exactly the cap, over it
        infos = [fp32(n) for _ in range(3) for n in (weight, 4)]  # weight, bias
        layouts = plan_buckets(infos, bucket_cap_bytes=400, world_size=2)
        assert [[s.param_index for s in b.spans] for b in layouts] == [[5, 4], [3, 2], [1, 0]]


def test_first_bucket_closes_at_its_own_cap():
    # Backward produces the last layers first: their bucket closes at the
    # smaller first cap, so its reduce-scatter starts early; later buckets
    # close at the full cap. A first cap above the bucket cap changes nothing.
    infos = [fp32(100) for _ in range(6)]
    layouts = plan_buckets(infos, bucket_cap_bytes=1200, world_size=2, first_bucket_cap_bytes=400)
    assert [[s.param_index for s in b.spans] for b in layouts] == [[5], [4, 3, 2], [1, 0]]
    same = plan_buckets(infos, bucket_cap_bytes=1200, world_size=2, first_bucket_cap_bytes=10**6)
    assert same == plan_buckets(infos, bucket_cap_bytes=1200, world_size=2)
    check_layout(infos, layouts, 2)


def test_per_bucket_caps_in_backward_order():
    # torch DDP's bucket_cap_mb_list: the k-th bucket to close closes at the
    # k-th cap, the last cap for every later one; it overrides both other caps.
    infos = [fp32(100) for _ in range(7)]
    layouts = plan_buckets(infos, bucket_cap_bytes=10**6, world_size=2, first_bucket_cap_bytes=400,
                           bucket_caps_bytes=[800, 400])
    assert [[s.param_index for s in b.spans] for b in layouts] == [[6, 5], [4], [3], [2], [1], [0]]
    check_layout(infos, layouts, 2)


def test_spans_carry_the_parameters_strides():
    infos = [ParamInfo(24, "float32", 4, (12, 1, 6, 3)), fp32(5)]
    (layout,) = plan_buckets(infos, bucket_cap_bytes=10**6, world_size=3)
    assert {s.param_index: s.strides for s in layout.spans} == {0: (12, 1, 6, 3), 1: None}


def test_default_bucket_cap_is_sized_to_the_model():
    assert default_bucket_cap_mb(64 * 2**20) == 4.0  # a 16M-parameter fp32 model: 16 buckets
    assert default_bucket_cap_mb(10**4) == 1.0  # small models: never below 1 MB
    assert default_bucket_cap_mb(28 * 2**30) == 25.0  # a 7B model: torch DDP's 25 MB


def test_reverse_registration_order_by_default():
    layouts = plan_buckets([fp32(10), fp32(20), fp32(30)], bucket_cap_bytes=10**6, world_size=2)
    assert [s.param_index for s in layouts[0].spans] == [2, 1, 0]


def test_parameter_straddles_slices():
    layouts = plan_buckets([fp32(1000)], bucket_cap_bytes=10**6, world_size=3)
    pieces = [layouts[0].shard_pieces(r) for r in range(3)]
    assert all(len(p) == 1 and p[0].param_index == 0 for p in pieces)
    assert [p[0].param_offset for p in pieces] == [0, pieces[0][0].numel, 2 * pieces[0][0].numel]


@pytest.mark.parametrize("kwargs, message", [
    ({"bucket_cap_bytes": -1, "world_size": 2}, "bucket_cap_bytes"),
    ({"bucket_cap_bytes": 100, "world_size": 0}, "world_size"),
    ({"bucket_cap_bytes": 100, "world_size": 2, "order": [0, 0]}, "permutation"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_buckets([fp32(3), fp32(4)], **kwargs)


def test_a_cap_of_0_bytes_gives_each_parameter_a_bucket_of_its_own():
    # As torch DDP's bucket_cap_mb=0 (or under a byte); an empty parameter in none.
    layouts = plan_buckets([fp32(3), fp32(0), fp32(4)], bucket_cap_bytes=0, world_size=2)
    assert [[s.param_index for s in layout.spans] for layout in layouts] == [[2], [0]]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["f32", "bf16"])),
                      min_size=1, max_size=12), world=st.integers(1, 5),
       cap=st.integers(4, 2000), device_type=st.sampled_from(["cpu", "cuda"]))
def test_every_parameter_starts_aligned(sizes, world, cap, device_type):
    # As a parameter torch allocates by itself (64 bytes on the CPU): torch's CPU
    # kernels round differently on misaligned data (a Linear(64, 1) forward on a batch
    # of 5), and the parameters are the views the forward reads. On CUDA, 256: the
    # most cuBLASLt is told of.
    align = param_alignment_for(device_type)
    assert align == {"cpu": 64, "cuda": 256}[device_type]
    infos = [fp32(n) if d == "f32" else ParamInfo(n, "bfloat16", 2) for n, d in sizes]
    layouts = plan_buckets(infos, bucket_cap_bytes=cap, world_size=world,
                           param_align_bytes=align)
    check_layout(infos, layouts, world)
    for layout in layouts:
        for span in layout.spans:
            assert span.bucket_offset * layout.element_size % align == 0
        # The spans and the filler (gaps and tail padding) tile the buffer.
        pieces = sorted([(s.bucket_offset, s.bucket_end) for s in layout.spans]
                        + list(layout.filler_ranges()))
        assert pieces[0][0] == 0 and pieces[-1][1] == layout.padded_numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(lo < hi for lo, hi in pieces)
