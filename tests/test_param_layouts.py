"""Parameters keep their memory layout in their buckets (no processes)."""
import pytest
import torch

from fgpsdp_runtime.buckets import BucketStorage, memory_dim_order, span_as_param, to_bucket_order
from fgpsdp_runtime.layout import ParamInfo, plan_buckets

CL = torch.channels_last


def _tensors():
    """(name, tensor, its expected dim order)."""
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    pointwise = torch.randn(6, 4, 1, 1)
    return [
        ("row_major", base.clone(), None),
        ("channels_last", base.to(memory_format=CL), (0, 2, 3, 1)),
        # A 1x1 conv weight: only the size-1 dims' strides tell the layouts apart,
        # and cuDNN's format choice reads them.
        ("pointwise_channels_last", pointwise.to(memory_format=CL), (0, 2, 3, 1)),
        ("pointwise_row_major", pointwise.clone(), None),
        ("column_major", torch.randn(5, 7).t().contiguous().t(), (1, 0)),
        ("not_dense", torch.randn(5, 8)[:, ::2], None),
        ("expanded", torch.randn(5, 1).expand(5, 4), None),
        ("vector", torch.randn(9), None),
    ]


@pytest.mark.parametrize("name, tensor, order", _tensors(), ids=[t[0] for t in _tensors()])
def test_dim_order_and_round_trip(name, tensor, order):
    assert memory_dim_order(tensor) == order
    flat = to_bucket_order(tensor, order)
    assert flat.shape == (tensor.numel(),)
    view = span_as_param(flat.clone(), tensor.shape, order)
    assert torch.equal(view, tensor)
    if order is not None or tensor.is_contiguous():
        # Dense tensors: the view has their strides, and they go into a span without a copy.
        assert view.stride() == tensor.stride()
        assert flat.data_ptr() == tensor.data_ptr()


def test_other_layout_goes_into_a_span_in_its_order():
    """A row-major tensor (a checkpoint's state) packed into a channels_last span."""
    param = torch.randn(3, 4, 2, 5).to(memory_format=CL)
    row_major = param.contiguous()
    order = memory_dim_order(param)
    assert torch.equal(to_bucket_order(row_major, order), to_bucket_order(param, order))
    assert not torch.equal(to_bucket_order(row_major, order), row_major.reshape(-1))


def test_bucket_storage_keeps_layouts_and_values():
    params = [torch.nn.Parameter(t.clone(memory_format=torch.preserve_format))
              for _, t, _ in _tensors() if t.is_contiguous() or memory_dim_order(t)]
    before = [(p.detach().clone(), p.stride()) for p in params]
    infos = [ParamInfo(p.numel(), "float32", 4, memory_dim_order(p)) for p in params]
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
                           to_bucket_order(value, span.dim_order))
