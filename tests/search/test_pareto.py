import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from stratagem.search.pareto import dominates, nondominated

D3 = ("maximize", "maximize", "minimize")


def brute(values: np.ndarray, directions) -> np.ndarray:
    """O(n^2) definition: i is on the front unless some j is no worse everywhere and better somewhere."""
    m = values * np.array([-1.0 if d == "maximize" else 1.0 for d in directions])
    le = np.all(m[:, None, :] <= m[None, :, :], axis=2)
    lt = np.any(m[:, None, :] < m[None, :, :], axis=2)
    return np.flatnonzero(~np.any(le & lt, axis=0))


@st.composite
def point_sets(draw):
    k = draw(st.integers(1, 4))
    n = draw(st.integers(0, 400))
    coarse = draw(st.booleans())  # few distinct values: many ties and duplicate rows
    elements = st.integers(0, 6).map(float) if coarse else st.floats(-1e6, 1e6, allow_nan=False)
    values = draw(arrays(np.float64, (n, k), elements=elements))
    directions = draw(st.lists(st.sampled_from(["maximize", "minimize"]), min_size=k, max_size=k))
    return values, directions


@settings(max_examples=150, deadline=None)
@given(point_sets())
def test_nondominated_matches_brute_force(case) -> None:
    values, directions = case
    assert np.array_equal(nondominated(values, directions), brute(values, directions))


def test_large_three_objective_front_matches_brute_force() -> None:
    rng = np.random.default_rng(7)
    v = rng.normal(size=(3000, 3))
    v[:, 1] = -v[:, 0] + 0.3 * v[:, 1]  # anti-correlated: a large front
    v[::7] = np.round(v[::7], 1)  # and some ties
    assert np.array_equal(nondominated(v, D3), brute(v, D3))


def test_dominates_and_bad_input() -> None:
    assert dominates([2, 5, 1], [1, 5, 1], D3)
    assert not dominates([2, 5, 1], [2, 5, 1], D3)
    assert not dominates([2, 4, 1], [1, 5, 1], D3)
    with pytest.raises(ValueError):
        nondominated(np.array([[np.nan, 1, 1]]), D3)
    with pytest.raises(ValueError):
        nondominated(np.ones((2, 2)), D3)
