"""lsgd_hpc.aggregate.rank_correlation against values worked out by hand."""
import math
import warnings

import numpy as np
import pytest

from lsgd_hpc.analysis.aggregate import rank_correlation


def test_spearman_without_ties():
    # ranks = values; d = (-1, 1, -1, 1, 0), sum d^2 = 4: rho = 1 - 6*4 / (5*24) = 0.8
    assert rank_correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # only the order matters: any increasing transform of either sample gives the same rho
    assert rank_correlation([10, 20, 30, 40, 50], np.exp([2, 1, 4, 3, 5])) == pytest.approx(0.8)
    assert rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)


def test_kendall_without_ties():
    # 10 pairs, discordant (1,2) and (3,4): tau = (8 - 2) / 10
    assert rank_correlation([1, 2, 3, 4, 5], [2, 1, 4, 3, 5], "kendall") == pytest.approx(0.6)
    assert rank_correlation([1, 2, 3], [30, 20, 10], method="kendall") == pytest.approx(-1.0)


def test_ties_use_average_ranks_and_tau_b():
    # x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4); deviations (-1.5, 0, 0, 1.5) and
    # (-1.5, -.5, .5, 1.5): rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9)
    x, y = [1, 2, 2, 3], [1, 2, 3, 4]
    assert rank_correlation(x, y) == pytest.approx(math.sqrt(0.9))
    # tau-b: 5 concordant, 0 discordant, 1 pair tied in x: 5 / sqrt((6 - 1) * (6 - 0))
    assert rank_correlation(x, y, "kendall") == pytest.approx(5 / math.sqrt(30))
    # ties on both sides cancelling out
    assert rank_correlation([1, 1, 2, 2], [1, 2, 1, 2]) == pytest.approx(0.0)
    assert rank_correlation([1, 1, 2, 2], [1, 2, 1, 2], "kendall") == pytest.approx(0.0)


def test_undefined_is_nan():
    # quietly: a table of correlations over many predictors must not flood stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in ("spearman", "kendall"):
            assert math.isnan(rank_correlation([3, 3, 3], [1, 2, 3], method))   # constant x
            assert math.isnan(rank_correlation([1, 2, 3], [5, 5, 5], method))   # constant y
            assert math.isnan(rank_correlation([1], [2], method))               # one pair
            assert math.isnan(rank_correlation([], [], method))


def test_non_finite_pairs_are_left_out():
    # the NaN pair and the inf pair are dropped: what is left is the first test's samples
    x = [1, 2, np.nan, 3, 4, 9, 5]
    y = [2, 1, 7, 4, 3, np.inf, 5]
    assert rank_correlation(x, y) == pytest.approx(0.8)
    assert rank_correlation(x, y, "kendall") == pytest.approx(0.6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="differ in length"):
        rank_correlation([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="spearman, kendall"):
        rank_correlation([1, 2, 3], [1, 2, 3], method="pearson")
