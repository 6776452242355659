"""The synchronizer's rules (lowcomm.optim.synchronizer), each against values worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.optim.synchronizer import (
    DelayedNesterov,
    balanced_fragments,
    dynamic_local_steps,
    grace_window_s,
    radial_directional_average,
    token_weight,
    weighted_average,
)


def test_a_token_weight_is_tokens_times_tokens_per_step():
    assert token_weight(4096, 4) == 4096 * 1024  # 4 steps of 1,024 tokens
    # the same tokens in twice the steps (half the batch: a learner that lost half its devices)
    assert token_weight(4096, 8) == token_weight(4096, 4) / 2
    assert token_weight(0, 0) == 0.0
    with pytest.raises(ValueError, match="counts >= 0"):
        token_weight(-1, 2)


def test_the_radial_directional_average_keeps_the_mean_norm_along_the_mean_direction():
    # two orthogonal outer gradients of norm 2, equal weights: the plain mean has norm sqrt(2),
    # the radial-directional one norm 2, along the diagonal
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    torch.testing.assert_close(weighted_average([a, b], [1, 1]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(radial_directional_average([a, b], [1, 1]), torch.tensor([math.sqrt(2), math.sqrt(2)]))
    # weights 3:1 (normalised to 3/4, 1/4): norm 3/4 * 2 + 1/4 * 4 = 2.5 along (3/4, 1/4) / |(3/4, 1/4)|
    c = torch.tensor([0.0, 4.0])
    expected = torch.tensor([0.75, 0.25]) / math.sqrt(0.75**2 + 0.25**2) * 2.5
    torch.testing.assert_close(radial_directional_average([a, c], [3, 1]), expected)
    # a zero outer gradient adds its share of the norm (0) and no direction
    torch.testing.assert_close(radial_directional_average([a, torch.zeros(2)], [1, 1]), torch.tensor([1.0, 0.0]))
    # directions that cancel: the plain weighted mean, (a - 2a) / 2 (where the norms' mean, 3,
    # along no direction would be noise)
    torch.testing.assert_close(radial_directional_average([a, -2 * a], [1, 1]), -a / 2)
    with pytest.raises(ValueError, match="no learner contributed"):
        radial_directional_average([a, b], [0, 0])


def test_balanced_fragments_put_the_largest_tensors_first_into_the_lightest_fragment():
    # 5 -> A; 4 -> B; 3 -> B (4 < 5): 7; 3 -> A (5 < 7): 8; 3 -> B (7 < 8): 10
    assert balanced_fragments([3, 5, 3, 4, 3], 2) == [[1, 2], [0, 3, 4]]
    assert balanced_fragments([7], 1) == [[0]]
    with pytest.raises(ValueError, match="at least one tensor each"):
        balanced_fragments([1, 2], 3)


def test_the_grace_window_takes_gamma_of_the_slack_the_overlap_leaves():
    # tau = 2 steps of 0.5 s: 1 s; quorum waited 0.2 s, the sync takes 0.3 s: slack 0.5 s
    assert grace_window_s(2, 0.5, 0.2, 0.3, gamma=0.4) == pytest.approx(0.2)
    assert grace_window_s(2, 0.5, 0.9, 0.3, gamma=0.4) == 0.0  # no slack: no window
    assert grace_window_s(0, 0.5, 0.0, 0.0, gamma=0.4) == 0.0  # no overlap: no window
    with pytest.raises(ValueError, match="gamma"):
        grace_window_s(2, 0.5, 0.2, 0.3, gamma=1.0)


def test_dynamic_local_steps_follow_each_learners_speed():
    assert dynamic_local_steps([2.0, 1.0, 0.5], 10) == [10, 5, 2]
    assert dynamic_local_steps([1.0, 0.01], 10) == [10, 1]  # at least one step
    assert dynamic_local_steps([3.0, 3.0], 7) == [7, 7]
    with pytest.raises(ValueError, match="speeds"):
        dynamic_local_steps([1.0, 0.0], 10)


def test_delayed_nesterov_over_a_block_is_one_nesterov_step_on_the_mean():
    lr, beta, n = 0.5, 0.9, 2
    rule = DelayedNesterov(lr=lr, momentum=beta, period=n)
    theta = [torch.tensor([1.0])]
    # first arrival g=2: theta -= 0.5 * 2 / 2 = 0.5 -> 0.5 (no momentum yet)
    rule.apply(theta, [torch.tensor([2.0])])
    assert theta[0].item() == pytest.approx(0.5)
    # second arrival g=4, the block ends: m = 0.9 * 0 + (2 + 4) / 2 = 3;
    # theta -= 0.5 * (4 / 2 + 0.9 * 3) = 2.35 -> -1.85
    rule.apply(theta, [torch.tensor([4.0])])
    assert theta[0].item() == pytest.approx(-1.85)
    # the block as one Nesterov step on the mean 3 from 1: m = 3, theta = 1 - 0.5 (3 + 0.9 * 3) = -1.85
    nesterov = 1 - lr * (3 + beta * 3)
    assert theta[0].item() == pytest.approx(nesterov)
    # the next block: g = 0, 0 -> m = 0.9 * 3 = 2.7; theta -= 0.5 * 0.9 * 2.7 at its end
    rule.apply(theta, [torch.tensor([0.0])])
    assert theta[0].item() == pytest.approx(-1.85)
    rule.apply(theta, [torch.tensor([0.0])])
    assert theta[0].item() == pytest.approx(-1.85 - 0.5 * 0.9 * 2.7)
    # the state resumes: a copy continues exactly as the original
    copy = DelayedNesterov(lr=lr, momentum=beta, period=n)
    copy.load_state_dict(rule.state_dict())
    a, b = [theta[0].clone()], [theta[0].clone()]
    for g in (1.0, -3.0, 2.0):
        rule.apply(a, [torch.tensor([g])])
        copy.apply(b, [torch.tensor([g])])
    assert torch.equal(a[0], b[0]) and copy.arrivals == rule.arrivals == 7


def test_delayed_nesterov_with_a_period_of_one_is_nesterov_sgd():
    lr, beta = 0.1, 0.9
    rule = DelayedNesterov(lr=lr, momentum=beta, period=1)
    theta, ours = torch.tensor([1.0, -2.0]), [torch.tensor([1.0, -2.0])]
    momentum = torch.zeros(2)
    for g in ([1.0, 0.5], [-2.0, 1.0], [0.3, 0.3]):
        g = torch.tensor(g)
        momentum = beta * momentum + g
        theta = theta - lr * (g + beta * momentum)
        rule.apply(ours, [g])
    torch.testing.assert_close(ours[0], theta)


def test_the_grace_windows_step_time_is_the_slowest_learners_smoothed():
    from lowcomm.optim.decoupled_diloco import SMOOTHING, Timings

    timings = Timings()
    timings.saw_step(0, 0.0)  # a first step (its start in it): not measured
    assert timings.step_s == 0.0
    timings.saw_step(0, 0.1)
    timings.saw_step(1, 0.4)
    timings.saw_step(0, 0.2)  # learner 0: 0.7 x 0.1 + 0.3 x 0.2 = 0.13
    assert timings.steps_s[0] == pytest.approx((1 - SMOOTHING) * 0.1 + SMOOTHING * 0.2)
    assert timings.step_s == 0.4  # the slowest learner's, whatever order the reports came in
    timings.forget(1)  # it finished: the others' steps set the window
    assert timings.step_s == pytest.approx(0.13)
