"""The reduce-scatter's sum adds every element's ranks left to right, whatever the
length of the rows: shared memory sums a chunk in slot-sized rounds and gloo sums
it whole, and the two must give the same bits (torch.sum(rows, dim=0) did not from
5 rows of float32 or float64 on: its order there depends on the row length)."""
import pytest
import torch

from fgpsdp_runtime.rank_order_sum import sum_in_rank_order

LENGTHS = [1, 7, 16, 33, 1000, 4097, 70001]


def _left_to_right(rows: torch.Tensor) -> torch.Tensor:
    """One element at a time, in Python: the definition."""
    wide = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    out = torch.empty(rows.shape[1], dtype=rows.dtype)
    for i in range(rows.shape[1]):
        total = rows[0, i].to(wide)
        for j in range(1, rows.shape[0]):
            total = total + rows[j, i].to(wide)
        out[i] = total.to(rows.dtype)
    return out


def _rows(n: int, length: int, dtype: torch.dtype, seed: int, spread: bool = False):
    gen = torch.Generator().manual_seed(seed)
    # Drawn in float64: float32 draws summed in float64 would be exact in any order.
    rows = torch.randn(n, length, generator=gen, dtype=torch.float64)
    if spread:
        rows *= 10.0 ** torch.randint(-3, 4, (n, length), generator=gen)
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8])
def test_each_element_is_added_left_to_right(dtype, n):
    for length in LENGTHS[:4] + [130]:  # the Python definition is slow
        rows = _rows(n, length, dtype, seed=n * 1000 + length, spread=True)
        out = torch.full((length,), float("nan"), dtype=dtype)
        sum_in_rank_order(rows, out)
        assert torch.equal(out, _left_to_right(rows)), (n, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_a_chunk_summed_in_pieces_has_the_bits_of_the_whole(dtype, n):
    for length in LENGTHS:
        rows = _rows(n, length, dtype, seed=100 + n)
        whole = torch.empty(length, dtype=dtype)
        sum_in_rank_order(rows, whole)
        for piece in (1, 5, 12, 256, 40000):
            if length // piece > 1000:
                continue  # a call per piece: the test's time, not a case of its own
            pieces = torch.empty(length, dtype=dtype)
            for lo in range(0, length, piece):
                sum_in_rank_order(rows[:, lo:lo + piece], pieces[lo:lo + piece])
            assert torch.equal(pieces, whole), (n, length, piece)


def test_strided_rows_as_shared_memory_passes_them():
    """Rows a stride apart (shared memory's slots[:, me, :]): the bits of contiguous ones."""
    n, m = 6, 4097
    slots = _rows(n * 3, m, torch.float32, seed=7).view(n, 3, m)
    strided, contiguous = torch.empty(m), torch.empty(m)
    sum_in_rank_order(slots[:, 1, :], strided)
    sum_in_rank_order(slots[:, 1, :].contiguous(), contiguous)
    assert torch.equal(strided, contiguous)
    assert torch.equal(strided[:130], _left_to_right(slots[:, 1, :130]))
