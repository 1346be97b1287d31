"""Kernels against their torch reference and float64, on fresh random data."""
import pytest
import torch

from fgpsdp_runtime import ops

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_tensors(dtype, device, sizes):
    # Fresh data every run (no fixed seed): the kernels must hold on any input.
    return [torch.randn(n, dtype=torch.float64).mul_(3).to(dtype=dtype, device=device)
            for n in sizes]


def float64_sum_squares(tensors):
    return sum(float(t.double().square().sum()) for t in tensors)


def test_extension_is_built():
    assert ops.extension_available(), "fgpsdp_runtime._C did not load"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [[1], [0], [0, 7, 0], [3, 1000, 17, 65537], [1_000_003]])
def test_sq_norm_matches_float64(dtype, device, sizes):
    tensors = random_tensors(dtype, device, sizes)
    out = ops.multi_tensor_sq_norm(tensors)
    ref = ops.reference_multi_tensor_sq_norm(tensors)
    assert out.dtype == torch.float64 and out.shape == (2,) and out.device.type == device
    exact = float64_sum_squares(tensors)
    # Both accumulate in float64: only summation order differs.
    assert float(out[0]) == pytest.approx(exact, rel=1e-12, abs=1e-300)
    assert float(ref[0]) == pytest.approx(exact, rel=1e-12, abs=1e-300)
    assert float(out[1]) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_sq_norm_on_cpu_does_not_depend_on_the_thread_count(dtype):
    """A speculative step measures its bucket's norm on the scheduler thread, which
    keeps the intra-op thread count it started with, not what the loop set since with
    torch.set_num_threads: the sum must be the same bit for bit (it was split by
    thread count: last-bit differences, and a clip coefficient of two_stage's
    differing from serial's)."""
    tensors = random_tensors(dtype, "cpu", [100_003, 1 << 16, 5, 1_000_003])
    before = torch.get_num_threads()
    try:
        sums = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            sums.append([float(ops.multi_tensor_sq_norm([t])[0]) for t in tensors]
                        + [float(ops.multi_tensor_sq_norm(tensors)[0])])
    finally:
        torch.set_num_threads(before)
    assert all(s == sums[0] for s in sums), sums


@pytest.mark.parametrize("device", DEVICES)
def test_sq_norm_closer_than_torch_fp32_norm(device):
    tensors = random_tensors(torch.float32, device, [1 << 20])
    exact = float64_sum_squares(tensors) ** 0.5
    ours = float(ops.multi_tensor_sq_norm(tensors)[0]) ** 0.5
    torch_fp32 = float(torch.linalg.vector_norm(tensors[0]))
    assert abs(ours - exact) <= abs(torch_fp32 - exact)
    assert abs(ours - exact) / exact < 1e-12


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_sq_norm_flags_non_finite(bad, device):
    tensors = random_tensors(torch.float32, device, [100, 5000])
    tensors[1][1234] = bad
    out = ops.multi_tensor_sq_norm(tensors)
    assert float(out[1]) == 1.0
    assert float(ops.reference_multi_tensor_sq_norm(tensors)[1]) == 1.0


def test_sq_norm_empty_list():
    out = ops.multi_tensor_sq_norm([])
    assert out.tolist() == [0.0, 0.0]


def test_sq_norm_rejects_bad_input():
    with pytest.raises(RuntimeError, match="not contiguous"):
        ops.multi_tensor_sq_norm([torch.randn(4, 6).t()])
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.multi_tensor_sq_norm([torch.arange(5)])
    with pytest.raises(RuntimeError, match="is on meta"):
        ops.multi_tensor_sq_norm([torch.randn(3), torch.empty(3, device="meta")])


def _random_like_sizes(dtype, device, sizes):
    return [torch.randn(n, dtype=torch.float64).to(dtype=dtype, device=device) for n in sizes]


PACK_SIZES = [[1], [0, 5], [3, 1000, 17, 65537, 0, 1], [1 << 20]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("sizes", PACK_SIZES)
def test_pack_matches_reference(src_dtype, flat_dtype, sizes, device):
    tensors = _random_like_sizes(src_dtype, device, sizes)
    offsets, cursor = [], 3  # an odd start: offsets need no alignment
    for t in tensors:
        offsets.append(cursor)
        cursor += t.numel() + 2
    scale = 1.0 / 3.0
    flat = torch.full((cursor + 1,), 7.0, dtype=flat_dtype, device=device)
    expected = flat.clone()
    ops.multi_tensor_pack(tensors, flat, offsets, scale)
    ops.reference_multi_tensor_pack(tensors, expected, offsets, scale)
    assert torch.equal(flat, expected)  # elementwise: same rounding, bit for bit
    # Gaps between tensors are untouched.
    assert float(flat[0]) == 7.0 and float(flat[-1]) == 7.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", PACK_SIZES)
def test_unpack_inverts_pack(dtype, sizes, device):
    tensors = _random_like_sizes(dtype, device, sizes)
    offsets = [sum(t.numel() for t in tensors[:i]) for i in range(len(tensors))]
    flat = torch.empty(max(1, sum(t.numel() for t in tensors)), dtype=dtype, device=device)
    ops.multi_tensor_pack(tensors, flat, offsets, 1.0)
    out = [torch.empty_like(t) for t in tensors]
    ops.multi_tensor_unpack(flat, out, offsets, 1.0)
    for a, b in zip(out, tensors):
        assert torch.equal(a, b)
    ref = [torch.empty_like(t) for t in tensors]
    ops.multi_tensor_unpack(flat, out, offsets, 2.0)
    ops.reference_multi_tensor_unpack(flat, ref, offsets, 2.0)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_references_leave_their_inputs_alone(dtype):
    # They run where the extension has no kernels for the device (a CUDA tensor,
    # _C built without CUDA): before, with equal dtypes, pack scaled the gradients
    # in place and unpack the flat buffer.
    tensors = random_tensors(dtype, "cpu", [5, 17])
    before = [t.clone() for t in tensors]
    flat = torch.zeros(22, dtype=dtype)
    ops.reference_multi_tensor_pack(tensors, flat, [0, 5], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    flat_before = flat.clone()
    ops.reference_multi_tensor_unpack(flat, [torch.empty_like(t) for t in tensors], [0, 5], 2.0)
    assert torch.equal(flat, flat_before)


def test_pack_rejects_bad_input():
    flat = torch.zeros(10)
    with pytest.raises(RuntimeError, match="not contiguous"):
        ops.multi_tensor_pack([torch.randn(2, 3).t()], flat, [0], 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.multi_tensor_pack([torch.randn(6)], flat, [5], 1.0)
    with pytest.raises(RuntimeError, match="2 tensors but 1 offsets"):
        ops.multi_tensor_pack([torch.randn(2), torch.randn(2)], flat, [0], 1.0)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.multi_tensor_pack([torch.arange(3)], flat, [0], 1.0)
    with pytest.raises(RuntimeError, match="not contiguous"):
        ops.multi_tensor_unpack(torch.zeros(4, 4).t(), [torch.zeros(3)], [0], 1.0)
