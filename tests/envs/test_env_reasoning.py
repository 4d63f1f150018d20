import pytest

pytest.importorskip("reasoning_gym")

from rollart.envs import make_env  # noqa: E402
from rollart.envs.reasoning import ReasoningGymEnv  # noqa: E402


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "countdown"])
def test_correct_answer_scores_one(dataset):
    env = make_env("reasoning_gym", {"dataset": dataset, "size": 50})
    assert env.legal_actions() is None and "<answer>" in env.instruction
    for seed in (0, 7):
        question, info = env.reset(seed)
        assert question and info["answer"] is not None
        obs, r, term, trunc, info2 = env.step(str(info["answer"]))
        assert (r, term, trunc, info2["success"], info2["valid_action"]) == (1.0, True, False, True, True)


def test_wrong_answer_scores_zero_and_odd_text_does_not_crash():
    env = ReasoningGymEnv(dataset="basic_arithmetic")
    env.reset(1)
    _, r, term, _, info = env.step("definitely not a number")
    assert r == 0.0 and term and info["success"] is False
    env.reset(2)
    assert env.step("")[1] == 0.0
    with pytest.raises(RuntimeError):
        env.step("again")


def test_deterministic_by_seed_modulo_size():
    env = ReasoningGymEnv(dataset="chain_sum", size=10)
    q = [env.reset(s)[0] for s in range(10)]
    assert q == [env.reset(s + 10)[0] for s in range(10)]
    assert len(set(q)) > 5
    assert env.reset(3)[1]["index"] == 3


def test_dataset_args_pass_through():
    env = ReasoningGymEnv(dataset="chain_sum", dataset_args={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    q, _ = env.reset(0)
    assert len([t for t in q.replace("=", " ").split() if t.isdigit()]) == 2, q


def test_bad_args():
    with pytest.raises(ValueError, match="'dataset'"):
        ReasoningGymEnv(dataset="no_such_dataset")
    with pytest.raises(ValueError, match="'dataset_args'"):
        ReasoningGymEnv(dataset="chain_sum", dataset_args={"bogus": 1})
    with pytest.raises(ValueError, match="'size'"):
        ReasoningGymEnv(dataset="chain_sum", size=0)


def test_held_out_seeds_serve_items_no_training_seed_serves():
    """The evaluation's task seeds (HELDOUT_SEED_OFFSET + i) map to items reserved for it:
    before, ``seed % size`` gave held-out seed 1_000_000 + i the training item i."""
    from rollart.envs.base import HELDOUT_SEED_OFFSET

    env = ReasoningGymEnv(dataset="chain_sum", size=100, heldout=20,
                          dataset_args={"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2})
    train = {env.reset(s)[1]["index"] for s in range(0, 5000, 7)}
    held = {env.reset(HELDOUT_SEED_OFFSET + i)[1]["index"] for i in range(300)}
    assert train <= set(range(100)) and held == set(range(100, 120))
    q_train = [env.reset(i)[0] for i in range(20)]
    q_held = [env.reset(HELDOUT_SEED_OFFSET + i)[0] for i in range(20)]
    assert not set(q_train) & set(q_held), "a held-out question is a training question"
    info = env.reset(HELDOUT_SEED_OFFSET + 3)[1]
    assert info["index"] == 103 and info["heldout"] is True
    assert env.reset(3)[1]["heldout"] is False
    with pytest.raises(ValueError, match="'heldout'"):
        ReasoningGymEnv(dataset="chain_sum", heldout=0)


def test_binary_rewards_only_a_success():
    args = {"dataset": "basic_arithmetic", "dataset_args": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                            "max_digits": 1, "operators": ["+"]}}
    seed = next(s for s in range(100) if len(str(ReasoningGymEnv(**args).reset(s)[1]["answer"])) == 1)
    partial, binary = ReasoningGymEnv(**args), ReasoningGymEnv(**args, binary=True)
    answer = str(partial.reset(seed)[1]["answer"])
    binary.reset(seed)
    farmed = answer * 2  # the reply holds the answer: partial credit from the verifier
    r_partial, r_binary = partial.step(farmed)[1], binary.step(farmed)[1]
    assert 0 < r_partial < 1 and r_binary == 0.0
    binary.reset(seed)
    assert binary.step(answer)[1] == 1.0
    with pytest.raises(ValueError, match="'binary'"):
        ReasoningGymEnv(**args, binary="yes")
