"""Parameters keep their memory layout in their buckets (no processes)."""
import pytest
import torch

from fgpsdp_runtime.buckets import (BucketStorage, layout_strides, memory_dim_order, span_as_param,
                                    to_bucket_order)
from fgpsdp_runtime.layout import ParamInfo, plan_buckets

CL = torch.channels_last


def _tensors():
    """(name, tensor, whether its strides are kept, its element order)."""
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    pointwise = torch.randn(6, 4, 1, 1)
    depthwise = torch.randn(6, 1, 3, 3)
    return [
        ("row_major", base.clone(), False, None),
        ("channels_last", base.to(memory_format=CL), True, (0, 2, 3, 1)),
        # Size-1 dims: their strides are free, and torch's format choice reads them
        # (a 1x1 conv's weight; a depthwise or single-input-channel conv's weight).
        ("pointwise_channels_last", pointwise.to(memory_format=CL), True, None),
        ("pointwise_row_major", pointwise.clone(), False, None),
        ("depthwise_channels_last", depthwise.to(memory_format=CL), True, None),
        ("channels_last_3d", torch.randn(4, 2, 3, 3, 3).to(memory_format=torch.channels_last_3d),
         True, (0, 2, 3, 4, 1)),
        ("column_major", torch.randn(5, 7).t().contiguous().t(), True, (1, 0)),
        ("not_dense", torch.randn(5, 8)[:, ::2], False, None),
        ("expanded", torch.randn(5, 1).expand(5, 4), False, None),
        ("vector", torch.randn(9), False, None),
    ]


@pytest.mark.parametrize("name, tensor, kept, order", _tensors(), ids=[t[0] for t in _tensors()])
def test_layout_and_round_trip(name, tensor, kept, order):
    strides = layout_strides(tensor)
    assert strides == (tuple(tensor.stride()) if kept else None)
    assert memory_dim_order(tensor) == order
    flat = to_bucket_order(tensor, strides)
    assert flat.shape == (tensor.numel(),)
    view = span_as_param(flat.clone(), tensor.shape, strides)
    assert torch.equal(view, tensor)
    if kept or tensor.is_contiguous():
        # Dense tensors: the view has their exact strides, and they go into a span
        # without a copy.
        assert view.stride() == tensor.stride()
        assert flat.data_ptr() == tensor.data_ptr()


def test_other_layout_goes_into_a_span_in_its_order():
    """A row-major tensor (a checkpoint's state) packed into a channels_last span."""
    param = torch.randn(3, 4, 2, 5).to(memory_format=CL)
    row_major = param.contiguous()
    strides = layout_strides(param)
    assert torch.equal(to_bucket_order(row_major, strides), to_bucket_order(param, strides))
    assert not torch.equal(to_bucket_order(row_major, strides), row_major.reshape(-1))


def test_bucket_storage_keeps_layouts_and_values():
    params = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format))
              for _, t, kept, _ in _tensors() if kept or t.is_contiguous()]
    before = [(p.detach().clone(), p.stride()) for p in params]
    infos = [ParamInfo(p.numel(), "float32", 4, layout_strides(p)) for p in params]
    (layout,) = plan_buckets(infos, bucket_cap_bytes=1 << 20, world_size=3)
    storage = BucketStorage(layout, [params[s.param_index] for s in layout.spans], 1)
    flat = storage.flat_param
    for span in layout.spans:
        p = params[span.param_index]
        value, stride = before[span.param_index]
        assert torch.equal(p, value) and p.stride() == stride
        # The span holds the parameter's elements in memory order.
        assert p.data_ptr() == flat[span.bucket_offset:].data_ptr()
        assert torch.equal(flat[span.bucket_offset:span.bucket_end],
                           to_bucket_order(value, span.strides))


@pytest.mark.parametrize("sizes", [[3, 7, 1, 16], [16, 32]])  # with gaps between, without
def test_send_buffer_holds_zeros_where_no_parameter_is(monkeypatch, sizes):
    # Parameters start 64-byte aligned on the CPU (layout.PARAM_ALIGN_BYTES), so a bucket of odd
    # sizes has gaps between them; they and the tail padding take part in the
    # reduce-scatter's sum and in the norm of the slice, so they must be zeros in
    # the buffer gradients are packed into, whatever memory it came from.
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    infos = [ParamInfo(n, "float32", 4) for n in sizes]
    (layout,) = plan_buckets(infos, bucket_cap_bytes=1 << 20, world_size=3)
    assert (len(layout.filler_ranges()) > 1) == (sizes == [3, 7, 1, 16])
    storage = BucketStorage(layout, [params[s.param_index] for s in layout.spans], 0)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty",
                        lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    send = storage.acquire_send_buffer()
    for lo, hi in layout.filler_ranges():
        assert torch.equal(send[lo:hi], torch.zeros(hi - lo))
    for span in layout.spans:  # left for the packing
        assert torch.isnan(send[span.bucket_offset:span.bucket_end]).all()
