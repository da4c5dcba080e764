"""Resharding a 1-D FSDP2 state onto another world size follows FSDP2's and DCP's split (torch.chunk on dim 0)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from gpuwatch.inplace.reshard import reshard  # noqa: E402


def _template(*placements: object) -> object:
    """What reshard reads of a DTensor of the new state: its placements (the values come from the old ranks)."""
    return types.SimpleNamespace(placements=placements, to_local=lambda: None)


@pytest.mark.parametrize(("rows", "old", "new"), [(10, 4, 3), (10, 3, 4), (2, 4, 3), (7, 2, 1)])
def test_each_new_rank_gets_its_torch_chunk_of_the_full_tensor(rows: int, old: int, new: int) -> None:
    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    olds = [{"w": part, "step": torch.tensor(5.0)} for part in torch.chunk(full, old, dim=0)]
    olds += [{"w": full[:0], "step": torch.tensor(5.0)}] * (old - len(olds))  # ranks past the last chunk: empty
    template = {"w": _template(Shard(0)), "step": 0}
    got = [reshard(olds, template, rank, new) for rank in range(new)]
    assert torch.equal(torch.cat([g["w"] for g in got]), full)  # nothing lost, nothing twice, in order
    expected = list(torch.chunk(full, new, dim=0))
    for rank, g in enumerate(got):
        assert torch.equal(g["w"], expected[rank] if rank < len(expected) else full[:0]), rank
        assert g["step"] is olds[0]["step"]  # what is not sharded comes from old rank 0


def test_a_replicated_dtensor_comes_from_old_rank_0_and_a_2d_mesh_is_refused() -> None:
    olds = [{"b": torch.ones(2) * r} for r in range(3)]
    assert torch.equal(reshard(olds, {"b": _template(Replicate())}, 1, 2)["b"], torch.zeros(2))
    with pytest.raises(ValueError, match="1-D mesh"):
        reshard(olds, {"b": _template(Shard(0), Shard(1))}, 0, 2)
