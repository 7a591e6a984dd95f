"""PATR's tree rollouts on a scripted environment: where it forks, when it stops a path, and the tree advantage.

The environment is a corridor (cells 0..4, the goal at 4): ``R`` moves right, ``L`` left, ``U`` bumps into
the wall (stays). The process score is the progress ``cell / 4``. The stepper hands each path the next action
scripted for its prefix, so every expected number below follows from the definitions by hand.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from learner.patr import Node, NodeRun, Tree, action_key, degenerate, grow_tree, node_run, tree_advantages


@dataclass
class Cfg:
    leaves: int = 4
    roots: int = 2
    branch: int = 2
    fork_every: int = 1
    fork_rounds: int = 2
    fork_top: int = 1
    max_tokens: int | None = None
    max_tool_calls: int | None = None
    repeat_n: int = 3
    invalid_n: int = 2
    score_floor: float = 0.0
    floor_k: int = 0
    stop_reward: float = 0.0


class Corridor:
    """A scripted stepper: ``choices[prefix]`` lists the actions handed out, in order, to the paths leaving ``prefix`` (then ``R``)."""

    def __init__(self, choices: dict[str, list[str]], max_depth: int = 8) -> None:
        self.choices = {k: list(v) for k, v in choices.items()}
        self.max_depth = max_depth
        self.requests: list[str] = []  # the prefix of every advance asked for

    @staticmethod
    def cell(path: str) -> int:
        c = 0
        for a in path:
            c = min(4, c + 1) if a == "R" else max(0, c - 1) if a == "L" else c
        return c

    def advance(self, requests):
        out = []
        for parent, _seed in requests:
            prefix = parent.run.trajectory_id.split(":", 1)[1] if parent is not None else ""
            self.requests.append(prefix)
            action = self.choices[prefix].pop(0) if self.choices.get(prefix) else "R"  # unscripted: walk on
            path = prefix + action
            cell = self.cell(path)
            done = cell == 4 or len(path) >= self.max_depth
            out.append(
                NodeRun(
                    trajectory_id=f"t{len(self.requests)}:{path}",
                    turns=1,
                    done=done,
                    reward=(1.0 if cell == 4 else 0.0) if done else None,
                    prefix_score=cell / 4,
                    actions=[f"move:{action}"],
                    tokens=3,
                )
            )
        return out


def path_of(node: Node) -> str:
    return node.run.trajectory_id.split(":", 1)[1]


def test_the_tree_forks_exactly_where_the_scorer_ranks_highest():
    # roots: "R" (score 0.25) and "L" (0.0) -> fork "R"; its children "RR" (0.5) and "RU" (0.25), and "LR" (0.25) -> fork "RR"
    env = Corridor({"": ["R", "L"], "R": ["R", "U"], "RR": ["R", "L"]})
    tree = grow_tree(env, Cfg(), random.Random(0))
    assert [path_of(tree.nodes[i]) for i in tree.fork_points] == ["R", "RR"]
    children = {path_of(n): sorted(path_of(tree.nodes[c]) for c in n.children) for n in tree.nodes.values()}
    assert children["R"] == ["RR", "RU"] and children["RR"] == ["RRL", "RRR"]
    assert children["L"] == ["LR"] and children["RU"] == ["RUR"]  # not forked: one child each
    assert len(tree.leaves) == 4  # 2 roots + 2 forks of b=2
    assert sorted(path_of(tree.nodes[i]) for i in tree.leaves) == ["LRRRR", "RRLRRR", "RRRR", "RURRR"]
    assert tree.budget.forks == 2 and tree.budget.runs == len(tree.nodes) and tree.budget.tokens == 3 * len(tree.nodes)


def test_a_path_repeating_an_action_n_times_without_progress_is_stopped():
    # "R" then "U" three times: the same action 3 times and the score stays 0.25 -> stopped after its 4th turn
    env = Corridor({"": ["R"], "R": ["U"], "RU": ["U"], "RUU": ["U"], "RUUU": ["R"]})
    tree = grow_tree(env, Cfg(roots=1, leaves=1, branch=1), random.Random(0))
    (leaf,) = [tree.nodes[i] for i in tree.leaves]
    assert path_of(leaf) == "RUUU" and leaf.depth == 4
    assert leaf.stopped is not None and "3 times" in leaf.stopped and leaf.leaf_reward == 0.0
    assert env.requests == ["", "R", "RU", "RUU"]  # no advance after the stop
    assert tree.budget.stopped == 1


def test_repeating_an_action_that_makes_progress_is_not_degenerate():
    env = Corridor({"": ["R"], "R": ["R"], "RR": ["R"], "RRR": ["R"]})
    tree = grow_tree(env, Cfg(roots=1, leaves=1, branch=1), random.Random(0))
    (leaf,) = [tree.nodes[i] for i in tree.leaves]
    assert path_of(leaf) == "RRRR" and leaf.stopped is None and leaf.leaf_reward == 1.0


def test_invalid_actions_and_a_dead_score_stop_paths():
    cfg = Cfg(invalid_n=2, floor_k=2, repeat_n=0)

    def path(actions: list[str], scores: list[float]) -> list[Node]:
        return [
            Node(i, i - 1 if i else None, i + 1, NodeRun(f"t{i}", 1, False, prefix_score=s, actions=[a]))
            for i, (a, s) in enumerate(zip(actions, scores))
        ]

    assert degenerate(path(["move:R", "invalid"], [0.5, 0.5]), cfg) is None
    assert "unreadable" in (degenerate(path(["move:R", "invalid", "invalid"], [0.5, 0.5, 0.5]), cfg) or "")
    assert degenerate(path(["move:R", "move:L"], [0.5, 0.0]), cfg) is None  # one advance at the floor is not enough
    assert "process score" in (degenerate(path(["move:R", "move:L", "move:U"], [0.5, 0.0, 0.0]), cfg) or "")


def hand_tree(shape: dict[int, tuple[int | None, float | None]]) -> Tree:
    """Nodes ``id -> (parent, leaf reward or None)``."""
    tree = Tree()
    for nid, (parent, reward) in shape.items():
        tree.nodes[nid] = Node(nid, parent, 0, NodeRun(f"t{nid}", 1, reward is not None), leaf_reward=reward)
        if parent is not None:
            tree.nodes[parent].children.append(nid)
        if reward is not None:
            tree.leaves.append(nid)
    return tree


def test_tree_advantages_on_a_hand_computed_tree():
    # n0 -> n1 (leaf, R=1), n2; n2 -> n3 (R=0), n4 (R=1).  mean 2/3, sample std sqrt(1/3)
    tree = hand_tree({0: (None, None), 1: (0, 1.0), 2: (0, None), 3: (2, 0.0), 4: (2, 1.0)})
    adv = tree_advantages(tree, eps=0.0)
    s = math.sqrt(1 / 3)
    assert adv[1] == pytest.approx((1 - 2 / 3) / s) and adv[4] == pytest.approx((1 - 2 / 3) / s)  # 0.57735
    assert adv[3] == pytest.approx((0 - 2 / 3) / s)  # -1.1547
    assert adv[2] == pytest.approx((0.5 - 2 / 3) / s)  # the shared prefix of n3, n4: (V(n2) - V(root)) / std = -0.288675
    assert adv[0] == pytest.approx(0.0)  # above every leaf: it separated nothing


def test_without_forks_the_tree_advantage_is_trajectory_grpo():
    # three independent two-node paths with rewards 1, 0, 0: A = (R - 1/3) / sqrt(1/3) on every node of the path
    tree = hand_tree({0: (None, None), 1: (0, 1.0), 2: (None, None), 3: (2, 0.0), 4: (None, None), 5: (4, 0.0)})
    adv = tree_advantages(tree, eps=0.0)
    s = math.sqrt(1 / 3)
    assert [round(adv[i], 6) for i in range(6)] == [round(x, 6) for x in [(2 / 3) / s] * 2 + [(-1 / 3) / s] * 4]


def test_equal_leaf_rewards_give_zero_advantages():
    tree = hand_tree({0: (None, None), 1: (0, 1.0), 2: (0, 1.0)})
    assert set(tree_advantages(tree).values()) == {0.0}


def test_action_keys_and_node_runs_from_a_runs_answer():
    assert action_key({"info": {"moves": "RRD", "format_error": False}}) == "move:D"
    assert action_key({"info": {"moves": "RR", "format_error": True}}) == "invalid"
    call = {"name": "calculator", "arguments": '{"expression": "2+3"}'}
    assert action_key({"tool_calls": [call], "text": "x"}) == action_key({"tool_calls": [call], "text": "y"})
    assert action_key({"text": " a  b "}) == "text:a b"
    answer = {
        "trajectory_id": "traj-1",
        "stop_reason": "paused",
        "reward": None,
        "prefix_score": 0.75,
        "completion_tokens": 7,
        "steps": [{"replayed": True, "text": "old"}, {"replayed": False, "text": "new", "tool_calls": [call, call]}],
    }
    run = node_run(answer)
    assert (run.turns, run.done, run.prefix_score, run.tokens, run.tool_calls) == (1, False, 0.75, 7, 2)


@pytest.mark.parametrize("budget", [{"max_tokens": 6}, {"max_tool_calls": 2}])
def test_no_fork_starts_once_the_tree_budget_is_spent(budget):
    # every advance costs 3 tokens and 1 tool call: the roots "R", "L" (6 tokens, 2 calls) use the budget up, so the
    # best prefix is not forked and each root walks on alone
    env = Corridor({"": ["R", "L"]})
    real = env.advance

    def costly(requests):
        runs = real(requests)
        for r in runs:
            r.tool_calls = 1
        return runs

    env.advance = costly  # type: ignore[method-assign]
    tree = grow_tree(env, Cfg(**budget), random.Random(0))
    assert tree.fork_points == [] and len(tree.leaves) == 2
    assert tree.budget.tool_calls == tree.budget.runs == len(tree.nodes)
