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
    served = [env.reset(s)[1]["index"] for s in range(10)]
    plain = [s for s in range(10) if not env.is_heldout(env.dataset[s]["question"])]
    assert plain and all(served[s] == s for s in plain)  # a held-out one moves to the next


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
    assert train <= set(range(100)) and len(held) == 20 and min(held) >= 100
    q_train = [env.reset(i)[0] for i in range(100)]
    q_held = [env.reset(HELDOUT_SEED_OFFSET + i)[0] for i in range(20)]
    assert not set(q_train) & set(q_held), "a held-out question is a training question"
    info = env.reset(HELDOUT_SEED_OFFSET + 3)[1]
    assert info["index"] >= 100 and info["heldout"] is True
    assert env.reset(3)[1]["heldout"] is False
    with pytest.raises(ValueError, match="'heldout'"):
        ReasoningGymEnv(dataset="chain_sum", heldout=0)


@pytest.mark.parametrize("max_digits", [1, 2])
def test_held_out_questions_are_never_trained_on(max_digits):
    """Split by question text, not by item: this generator repeats questions (one-digit sums
    have 100; 0-99 sums draw many 0s and 1s), so held-out *items* used to ask training
    questions (all 256 held-out questions of both settings were among the demonstrations)."""
    from rollart.envs.base import HELDOUT_SEED_OFFSET

    args = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": max_digits,
            "operators": ["+"], "allow_parentheses": False, "allow_negation": False}
    env = ReasoningGymEnv(dataset="basic_arithmetic", dataset_args=args, size=4000, heldout=256)
    q_train = {env.reset(s)[0] for s in range(4000)}
    q_held = [env.reset(HELDOUT_SEED_OFFSET + i)[0] for i in range(256)]
    assert not q_train & set(q_held), "a held-out question is asked in training"
    assert len(set(q_held)) >= 5 and len(q_train) >= (60 if max_digits == 1 else 400)
    # the split is the question's, so it is the same for another dataset seed and size
    other = ReasoningGymEnv(dataset="basic_arithmetic", dataset_args=args, size=500,
                            dataset_seed=7, heldout=64)
    assert not {other.reset(s)[0] for s in range(500)} & set(q_held)
    with pytest.raises(ValueError, match="'heldout_share'"):
        ReasoningGymEnv(dataset="chain_sum", heldout_share=1.0)


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


def test_held_out_items_are_found_once_per_process_and_only_as_far_as_asked():
    """Every env of a run asks for the same held-out items: an evaluation of 256 tasks
    (an env each) once timed out its resets while each env scanned 50,000 items alone."""
    from rollart.envs.base import HELDOUT_SEED_OFFSET

    args = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
            "operators": ["+"], "allow_parentheses": False, "allow_negation": False}
    envs = [ReasoningGymEnv(dataset="basic_arithmetic", dataset_args=args, size=3000,
                            dataset_seed=3) for _ in range(64)]
    qs = [env.reset(HELDOUT_SEED_OFFSET + i)[0] for i, env in enumerate(envs)]
    again = ReasoningGymEnv(dataset="basic_arithmetic", dataset_args=args, size=3000, dataset_seed=3)
    assert [again.reset(HELDOUT_SEED_OFFSET + i)[0] for i in range(64)] == qs
    from rollart.envs import reasoning

    found = [h for k, h in reasoning._HELD.items() if k[2] == 3 and k[3] == 3000]
    assert len(found) == 1 and len(found[0].found) == 64, "scanned past what was asked"
    assert found[0].next - found[0].start < 64 * 40  # about 10-20 per held-out item at share 0.1
    assert len(set(qs)) == 64, "an evaluation asks each held-out question once"


def test_only_the_evaluations_seed_window_is_held_out():
    """Held-out seeds are [HELDOUT_SEED_OFFSET, 2 * HELDOUT_SEED_OFFSET): a demonstration
    played from seed 5,000,000 (``beyond_demo.py``'s) is a training task. Before, every seed
    from the offset on was held out, so such demonstrations were the evaluation's questions:
    SFT memorised the held-out set (greedy 0.625) and RL then trained on questions SFT had
    never seen (sampled success 0.02)."""
    from rollart.envs.base import HELDOUT_SEED_OFFSET, is_heldout_seed

    assert not is_heldout_seed(HELDOUT_SEED_OFFSET - 1) and not is_heldout_seed(0)
    assert is_heldout_seed(HELDOUT_SEED_OFFSET) and is_heldout_seed(2 * HELDOUT_SEED_OFFSET - 1)
    assert not is_heldout_seed(2 * HELDOUT_SEED_OFFSET) and not is_heldout_seed(5_000_000)
    env = ReasoningGymEnv(dataset="chain_sum", size=1000, heldout=50)
    held = {env.reset(HELDOUT_SEED_OFFSET + i)[0] for i in range(50)}
    demo = [env.reset(5_000_000 + i) for i in range(200)]
    assert all(info["heldout"] is False and info["index"] < 1000 for _, info in demo)
    assert not held & {q for q, _ in demo}
