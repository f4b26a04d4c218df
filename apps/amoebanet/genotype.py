"""AmoebaNet-D and -B genotypes: each cell's ops, their input states and the concatenated states."""

from __future__ import annotations

from dataclasses import dataclass

# Ops a genotype may name; model.py builds each one.
OP_NAMES = (
    "none",
    "1x1",
    "3x3",
    "1x7_7x1",
    "max_pool_2x2",
    "max_pool_3x3",
    "avg_pool_3x3",
    "separable_3x3_2",
    "dil_2_separable_5x5_2",
)


@dataclass(frozen=True)
class CellGenotype:
    """One cell type, in the AmoebaNet reference's encoding.

    The cell starts with two states: 0 = the cell's input ``x`` (after a 1x1 conv to the cell's
    filters) and 1 = the skip input (the previous cell's input, matched to ``x``'s shape). Ops
    come in pairs: op ``2k`` reads state ``inputs[2k]``, op ``2k+1`` reads ``inputs[2k+1]``, and
    their sum becomes state ``k + 2``. The cell's output concatenates the states in ``concat``
    along channels. In a reduction cell the ops reading states 0 or 1 use stride 2.
    """

    ops: tuple[str, ...]
    inputs: tuple[int, ...]
    concat: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ops) != len(self.inputs) or len(self.ops) % 2:
            raise ValueError(
                f"a cell needs an even number of ops with one input each; got {len(self.ops)} ops "
                f"and {len(self.inputs)} inputs"
            )
        unknown = sorted(set(self.ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"unknown op(s) {unknown}; known ops: {list(OP_NAMES)}")
        num_states = 2 + len(self.ops) // 2
        for position, state in enumerate(self.inputs):
            # op 2k / 2k+1 may only read states that exist before state k + 2 is made
            if not 0 <= state < 2 + position // 2:
                raise ValueError(f"op {position} reads state {state}, which does not exist yet")
        if not self.concat or any(not 0 <= s < num_states for s in self.concat):
            raise ValueError(f"concat {self.concat} must name states in [0, {num_states})")


@dataclass(frozen=True)
class Genotype:
    """A normal cell and a reduction cell."""

    name: str
    normal: CellGenotype
    reduction: CellGenotype


AMOEBANET_D = Genotype(
    name="D",
    normal=CellGenotype(
        ops=("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1",
             "1x7_7x1", "max_pool_3x3", "none", "avg_pool_3x3", "1x1"),
        inputs=(1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellGenotype(
        ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1",
             "max_pool_3x3", "none", "max_pool_2x2", "avg_pool_3x3", "1x1"),
        inputs=(0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
        concat=(4, 5, 6),
    ),
)

AMOEBANET_B = Genotype(
    name="B",
    normal=CellGenotype(
        ops=("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1",
             "separable_3x3_2", "1x1", "none", "avg_pool_3x3", "1x1"),
        inputs=(1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
        concat=(0, 3, 4, 6),
    ),
    reduction=CellGenotype(
        ops=("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2",
             "max_pool_3x3", "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
        inputs=(0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
        concat=(5, 6),
    ),
)

GENOTYPES: dict[str, Genotype] = {"D": AMOEBANET_D, "B": AMOEBANET_B}


def get_genotype(name: str) -> Genotype:
    """Look up a genotype by name ("D" or "B", case-insensitive)."""
    try:
        return GENOTYPES[name.upper()]
    except KeyError:
        raise ValueError(f"unknown genotype {name!r}; choose one of {sorted(GENOTYPES)}") from None
