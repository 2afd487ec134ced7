"""The coordinate descent (evaluators.fitting): judging a field's trials together is the same descent."""

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.fitting import descend


def _loss(cal: Calibration) -> float:
    """A loss with its minimum inside the bounds and matmul efficiency's coupled attention efficiency in play."""
    return ((cal.matmul_efficiency - 0.41) ** 2 + (cal.attention_efficiency - 0.5) ** 2
            + (cal.half_efficiency_gflop - 3.3) ** 2 / 100 + (cal.layer_floor_ms - 0.7) ** 2)


def test_descending_with_a_bulk_loss_is_the_same_descent() -> None:
    fields = ("matmul_efficiency", "half_efficiency_gflop", "layer_floor_ms")
    calls: list[int] = []

    def losses(cals: list[Calibration]) -> list[float]:
        calls.append(len(cals))
        return [_loss(c) for c in cals]

    # the default's attention efficiency, and one that the coupling clips at 1
    for start in (Calibration(), Calibration(matmul_efficiency=0.3, attention_efficiency=0.9)):
        for refine in (False, True):
            plain = descend(start, fields, _loss, refine=refine)
            assert descend(start, fields, _loss, refine=refine, losses=losses) == plain
    assert calls and max(calls) > 1
