"""The batch scan: device-side scan of nested batches, host-side rows, drop and raise."""

from __future__ import annotations

import dataclasses
import math
from collections import namedtuple
from typing import Any

import pytest
import torch

from safetrain.detect import TARGET_KEYS, batch_error, describe_rows, drop_rows, iter_tensors, scan_batch
from safetrain.errors import BatchError
from safetrain.testing import count_host_syncs

NAN, INF = math.nan, math.inf
Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Sample:
    pixels: torch.Tensor
    label: torch.Tensor
    ids: list


def poisoned(rows: int = 4, cols: int = 3, bad: dict = None) -> torch.Tensor:
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    for (r, c), v in (bad or {}).items():
        t[r, c] = v
    return t


def bad_rows(scan: Any) -> list:
    return scan.row_bad.nonzero().flatten().tolist()


@pytest.mark.parametrize(
    "make, path_of_bad, expected_rows",
    [
        (lambda: poisoned(bad={(1, 0): NAN}), "batch", [1]),
        (lambda: (poisoned(bad={(2, 2): INF}), torch.arange(4)), "batch[0]", [2]),
        (lambda: [poisoned(), poisoned(bad={(0, 1): -INF, (3, 0): NAN})], "batch[1]", [0, 3]),
        (lambda: {"pixels": poisoned(bad={(3, 1): NAN}), "label": torch.arange(4)}, 'batch["pixels"]', [3]),
        (lambda: {"a": {"b": [poisoned(bad={(1, 1): INF})]}}, 'batch["a"]["b"][0]', [1]),
        (lambda: Pair(poisoned(bad={(0, 0): NAN}), torch.arange(4)), "batch[0]", [0]),
        (lambda: Sample(poisoned(bad={(2, 0): NAN}), torch.arange(4), list("abcd")), "batch.pixels", [2]),
    ],
)
def test_scan_finds_rows_in_nested_batches(make, path_of_bad, expected_rows):
    batch = make()
    scan = scan_batch(batch)
    assert bad_rows(scan) == expected_rows, f"rows of {path_of_bad}"
    assert bool(scan.flag), "flag must be set when a row is bad"
    assert all(torch.isfinite(t).all() for _, t in iter_tensors(scan.batch) if t.is_floating_point()), (
        "the batch handed to the forward must be finite"
    )
    found = describe_rows(batch)
    assert [(f.path, list(f.rows)) for f in found] == [(path_of_bad, expected_rows)], "describe_rows names the tensor"
    assert type(scan.batch) is type(batch), "containers keep their type"


def test_scan_makes_no_host_sync_and_keeps_the_structure():
    batch = {"pixels": poisoned(bad={(1, 0): NAN}), "label": torch.arange(4), "meta": "x"}
    with count_host_syncs() as syncs:
        scan = scan_batch(batch)
        _ = scan.values, scan.flag, scan.row_bad  # lazily computed, still on the device
    assert syncs.count == 0, str(syncs)
    assert scan.batch["label"] is batch["label"], "integer tensors are passed through untouched"
    assert scan.batch["meta"] == "x"
    assert scan.batch["pixels"][1].tolist() == [0.0, 4.0, 5.0], "non-finite values are zero-filled"
    assert batch["pixels"][1, 0].isnan(), "the original batch is not modified"
    assert scan.batch_size == 4


@pytest.mark.parametrize(
    "batch",
    [torch.arange(6), {"ids": torch.arange(6), "mask": torch.ones(6, dtype=torch.bool)}, ["a", 1, None], {}],
)
def test_nothing_floating_returns_the_same_object(batch):
    scan = scan_batch(batch)
    assert scan.batch is batch, "no copy when nothing is floating"
    assert scan.values == [] and scan.flag is None and scan.row_bad is None


def test_replace_uses_the_configured_values_not_dtype_max():
    x = torch.tensor([[NAN, INF, -INF, 1.0]])
    scan = scan_batch(x, replace=(0.0, 0.0, 0.0))
    assert scan.batch.tolist() == [[0.0, 0.0, 0.0, 1.0]], "the default replace must not give +-3.4e38"
    scan = scan_batch(x, replace=(-1.0, 5.0, -5.0))
    assert scan.batch.tolist() == [[-1.0, 5.0, -5.0, 1.0]]
    assert bool(scan.flag), "replaced rows are still reported"


def test_clean_false_skips_the_copy():
    x = poisoned(bad={(1, 1): NAN})
    scan = scan_batch(x, clean=False)
    assert scan.batch is x and bool(scan.flag)


def test_dict_batch_with_target_keys_splits_roles():
    batch = {"pixels": poisoned(), "labels": torch.tensor([0.0, NAN, 1.0, 2.0])}
    scan = scan_batch(batch, target_keys=TARGET_KEYS)
    assert not bool(scan.flag), "inputs are clean"
    assert bool(scan.target_flag) and scan.target_row_bad.tolist() == [False, True, False, False]
    found = describe_rows(batch, target_keys=TARGET_KEYS)
    assert [(f.kind, f.path, f.rows) for f in found] == [("target", 'batch["labels"]', (1,))]


def test_tensor_with_other_leading_size_marks_every_row():
    batch = {"x": poisoned(), "class_weights": torch.tensor([1.0, NAN])}
    scan = scan_batch(batch)
    assert scan.row_bad.tolist() == [True] * 4, "a non-batch tensor cannot be dropped row by row"
    assert [f.rows for f in describe_rows(batch)] == [(0, 1, 2, 3)]


def test_fp16_inputs_do_not_overflow_the_check():
    x = torch.ones(4, 40000, dtype=torch.float16)  # each row sums to 40000; the whole to 160000 > fp16 max
    scan = scan_batch(x)
    assert not bool(scan.flag) and not scan.row_bad.any(), "fp16 is summed in float32"


def test_describe_rows_counts_nan_and_inf_per_row():
    x = poisoned(bad={(1, 0): NAN, (1, 1): NAN, (3, 2): INF})
    (f,) = describe_rows({"pixels": x})
    assert (f.path, f.rows, f.nan_count, f.inf_count) == ('batch["pixels"]', (1, 3), 2, 1)
    assert f.row_counts == ((1, 2, 0), (3, 0, 1))
    assert (f.shape, f.dtype, f.kind) == ((4, 3), "float32", "input")
    assert describe_rows({"pixels": poisoned()}) == [], "a clean batch has no findings (a false alarm clears)"


def test_drop_rows_keeps_inputs_and_targets_aligned():
    x = poisoned(rows=5, bad={(1, 0): NAN, (3, 2): INF})
    y = torch.arange(5) * 10
    batch = Sample(x, y, ["a", "b", "c", "d", "e"])
    out = drop_rows(batch, [3, 1, 3])
    assert out.label.tolist() == [0, 20, 40], "integer targets follow their inputs"
    assert out.ids == ["a", "c", "e"], "a per-sample list is filtered too"
    assert out.pixels.tolist() == [x[0].tolist(), x[2].tolist(), x[4].tolist()]
    pair = drop_rows((x, y), [1, 3])
    assert pair[1].tolist() == [0, 20, 40] and torch.isfinite(pair[0]).all()
    with pytest.raises(BatchError, match="outside the batch of 5 rows"):
        drop_rows(batch, [7])


def test_batch_error_names_path_rows_and_counts():
    x = poisoned(bad={(3, 0): NAN, (3, 1): NAN, (0, 2): INF})
    error = batch_error(describe_rows({"pixels": x}))
    assert isinstance(error, BatchError)
    text = str(error)
    for part in ('batch["pixels"]', "rows [0, 3]", "2 NaN", "1 Inf"):
        assert part in text, f"{part!r} missing from: {text}"


def test_scan_matches_a_reference_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        x = torch.randn(8, 5, generator=gen)
        mask = torch.rand(8, 5, generator=gen) < 0.05
        x[mask] = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, (int(mask.sum()),), generator=gen)]
        expected = (~torch.isfinite(x)).any(1)
        scan = scan_batch({"x": x, "y": torch.arange(8)})
        assert scan.row_bad.tolist() == expected.tolist(), f"trial {trial}"
        assert bool(scan.flag) == bool(expected.any()), f"trial {trial}"
