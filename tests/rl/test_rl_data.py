"""RL prompt sets (reasoning-gym, JSONL, Parquet), the prompt sampler and the verifiers."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest

from megatron_tlt.config import ConfigError, DataConfig, RewardConfig
from megatron_tlt.rl import rewards as rewards_mod
from megatron_tlt.rl.data import DataError, PromptSampler, build_prompt_sets
from megatron_tlt.rl.rewards import RewardResult, Verifier
from megatron_tlt.tasks import Prompt, chat_token_ids, extract, normalize_exact

ASSISTANT_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from megatron_tlt.models import load_tokenizer

    return load_tokenizer(smollm2_dir)


def rg_cfg(**kw) -> DataConfig:
    base = dict(task="basic_arithmetic", train_size=24, eval_size=8, seed=0)
    base.update(kw)
    return DataConfig(**base)


def ids_of(prompts):
    return [(p.uid, p.token_ids, p.answer) for p in prompts]


# ----------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_prompts_deterministic_per_seed(tokenizer):
    train, evals = build_prompt_sets(rg_cfg(), tokenizer)
    assert len(train) == 24 and len(evals) == 8
    train2, evals2 = build_prompt_sets(rg_cfg(), tokenizer)
    assert ids_of(train) == ids_of(train2) and ids_of(evals) == ids_of(evals2)
    other, _ = build_prompt_sets(rg_cfg(seed=1), tokenizer)
    assert [p.entry["question"] for p in other] != [p.entry["question"] for p in train]
    assert train[0].uid == "basic_arithmetic:train:0" and evals[3].uid == "basic_arithmetic:eval:3"
    assert train.skipped_rows == 0 and train.stats["train_size"] == 24


def test_reasoning_gym_train_and_eval_disjoint(tokenizer):
    train, evals = build_prompt_sets(rg_cfg(train_size=64, eval_size=32), tokenizer)
    assert not {p.uid for p in train} & {p.uid for p in evals}
    assert not {p.entry["question"] for p in train} & {p.entry["question"] for p in evals}
    assert train.stats["eval_overlap"] == 0
    # the eval set does not depend on the training set's size
    _, evals_small = build_prompt_sets(rg_cfg(train_size=5, eval_size=32), tokenizer)
    assert ids_of(evals_small) == ids_of(evals)
    # the training set is a prefix of a larger one
    small, _ = build_prompt_sets(rg_cfg(train_size=5, eval_size=0), tokenizer)
    assert ids_of(small) == ids_of(train[:5])


def test_reasoning_gym_prompt_content(tokenizer):
    cfg = rg_cfg(train_size=3, eval_size=0, task_params={"min_terms": 2, "max_terms": 2},
                 instruction="Answer with a number.", system_prompt="Be brief.")
    train, evals = build_prompt_sets(cfg, tokenizer)
    assert evals == []
    for p in train:
        assert p.task == "basic_arithmetic" and p.entry["metadata"]["num_terms"] == 2
        assert p.messages == [{"role": "system", "content": "Be brief."},
                              {"role": "user",
                               "content": f"{p.entry['question']}\nAnswer with a number."}]
        assert p.answer == p.entry["answer"] and isinstance(p.answer, str)
        assert p.token_ids == chat_token_ids(tokenizer, p.messages)
        text = tokenizer.decode(p.token_ids)
        assert text.endswith(ASSISTANT_PROMPT) and text.count("<|im_start|>") == 3
        assert "Be brief." in text and "SmolLM" not in text  # replaces the default system
    # no system prompt: the chat template's default is kept
    (p,), _ = build_prompt_sets(rg_cfg(train_size=1, eval_size=0), tokenizer)
    assert p.messages[0]["role"] == "user" and "SmolLM" in tokenizer.decode(p.token_ids)


def test_reasoning_gym_bad_task_and_params(tokenizer):
    with pytest.raises(ConfigError, match="unknown reasoning-gym task.*basic_arithmetic"):
        build_prompt_sets(rg_cfg(task="basic_arithmetik"), tokenizer)
    with pytest.raises(ConfigError, match="does not accept parameter.*max_term"):
        build_prompt_sets(rg_cfg(task_params={"max_term": 3}), tokenizer)
    with pytest.raises(ConfigError, match="rejected parameters"):
        build_prompt_sets(rg_cfg(task_params={"min_terms": 5, "max_terms": 2}), tokenizer)
    with pytest.raises(ConfigError, match="size, seed|seed"):
        build_prompt_sets(rg_cfg(task_params={"seed": 3}), tokenizer)


def test_reasoning_gym_too_long_prompts(tokenizer):
    with pytest.raises(DataError, match=r"reasoning_gym:basic_arithmetic:train, line 1, "
                                        r"field 'question'.*max_prompt_tokens=10"):
        build_prompt_sets(rg_cfg(max_prompt_tokens=10), tokenizer)


# ----------------------------------------------------------------------------- files


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


GOOD_ROWS = [
    {"prompt": "What is 2 + 3?", "answer": 5},
    {"prompt": [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Half of one?"}], "answer": 0.5},
    {"prompt": "What is 10 / 4?", "answer": "2.5"},
    {"prompt": [{"role": "user", "content": "Two times three?"}], "answer": 6.0},
]


def file_cfg(path, source="jsonl", **kw):
    base = dict(source=source, path=str(path), train_size=0, eval_size=0,
                instruction="Put the answer in \\boxed{}.", system_prompt="")
    base.update(kw)
    return DataConfig(**base)


@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_file_prompts_string_and_chat(tokenizer, tmp_path, source):
    if source == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", GOOD_ROWS)
    else:
        # Parquet needs one column type: chat-message rows and string rows in two files
        path = write_parquet(tmp_path / "p.parquet", [GOOD_ROWS[1], GOOD_ROWS[3]])
    train, evals = build_prompt_sets(file_cfg(path, source), tokenizer)
    assert evals == [] and train.skipped_rows == 0
    by_answer = {p.answer: p for p in train}
    if source == "jsonl":
        assert [p.answer for p in train] == ["5", "0.5", "2.5", "6"]
        assert [p.uid for p in train] == [f"p.jsonl:{i}" for i in range(1, 5)]
        p = by_answer["5"]
        assert p.messages == [{"role": "user",
                               "content": "What is 2 + 3?\nPut the answer in \\boxed{}."}]
        assert p.entry == GOOD_ROWS[0] and p.task is None
    else:
        assert [p.answer for p in train] == ["0.5", "6"]
        assert [p.uid for p in train] == ["p.parquet:1", "p.parquet:2"]
    chat = by_answer["0.5"]
    assert chat.messages == [{"role": "system", "content": "Be terse."},
                             {"role": "user",
                              "content": "Half of one?\nPut the answer in \\boxed{}."}]
    for p in train:
        assert p.token_ids == chat_token_ids(tokenizer, p.messages)
        assert tokenizer.decode(p.token_ids).endswith(ASSISTANT_PROMPT)


def test_parquet_string_prompts_and_eval_split(tokenizer, tmp_path):
    rows = [{"question": f"What is {i} + 1?", "ref": i + 1} for i in range(10)]
    path = write_parquet(tmp_path / "q.parquet", rows)
    cfg = file_cfg(path, "parquet", prompt_field="question", answer_field="ref",
                   eval_size=3, train_size=4, system_prompt="Be brief.")
    train, evals = build_prompt_sets(cfg, tokenizer)
    assert [p.answer for p in train] == ["1", "2", "3", "4"]
    assert [p.answer for p in evals] == ["8", "9", "10"]  # the last eval_size rows
    assert train[0].messages[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ConfigError, match="eval_size=10 leaves no training rows"):
        build_prompt_sets(file_cfg(path, "parquet", prompt_field="question",
                                   answer_field="ref", eval_size=10), tokenizer)


BAD_ROWS = [
    # (row, field named in the error, what the message says)
    ({"answer": "1"}, "prompt", "missing"),
    ({"prompt": None, "answer": "1"}, "prompt", "missing"),
    ({"prompt": "Hi?"}, "answer", "missing"),
    ({"prompt": 7, "answer": "1"}, "prompt", "must be a string or a list"),
    ({"prompt": "Hi?", "answer": [1]}, "answer", "must be a string or a number"),
    ({"prompt": "Hi?", "answer": True}, "answer", "must be a string or a number"),
    ({"prompt": "Hi?", "answer": "  "}, "answer", "empty answer"),
    ({"prompt": "   ", "answer": "1"}, "prompt", "empty prompt"),
    ({"prompt": [], "answer": "1"}, "prompt", "empty list of messages"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "prompt", "no string 'content'"),
    ({"prompt": [{"content": "x"}], "answer": "1"}, "prompt", "no string 'role'"),
    ({"prompt": ["hello"], "answer": "1"}, "prompt", "message 0 is a str"),
    ({"prompt": [{"role": "system", "content": "x"}], "answer": "1"}, "prompt",
     "no message with role 'user'"),
    ({"prompt": "word " * 300, "answer": "1"}, "prompt", "max_prompt_tokens=64"),
    ("{not json", "<row>", "not valid JSON"),
    ("[1, 2]", "<row>", "must be a JSON object"),
]


@pytest.mark.parametrize("row,field,what", BAD_ROWS,
                         ids=[f"{i}-{f}-{w.split()[0]}" for i, (_, f, w) in enumerate(BAD_ROWS)])
def test_bad_jsonl_row_names_file_line_field(tokenizer, tmp_path, row, field, what):
    rows = [GOOD_ROWS[0], GOOD_ROWS[2], row, GOOD_ROWS[3]]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = file_cfg(path, max_prompt_tokens=64)
    with pytest.raises(DataError) as info:
        build_prompt_sets(cfg, tokenizer)
    err = info.value
    msg = str(err)
    assert str(path) in msg and "line 3" in msg and f"field {field!r}" in msg and what in msg
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    train, _ = build_prompt_sets(replace(cfg, skip_bad_rows=True), tokenizer)
    assert [p.answer for p in train] == ["5", "2.5", "6"]
    assert train.skipped_rows == 1 and train.stats["rows"] == 4
    assert [p.uid for p in train] == ["bad.jsonl:1", "bad.jsonl:2", "bad.jsonl:4"]


def test_jsonl_lines_count_blank_lines_and_errors_count_all(tokenizer, tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n".join([json.dumps(GOOD_ROWS[0]), "", json.dumps({"prompt": 1}),
                               json.dumps({"answer": 2}), json.dumps(GOOD_ROWS[2])]) + "\n")
    with pytest.raises(DataError, match=r"line 3, field 'prompt'.*1 more bad row"):
        build_prompt_sets(file_cfg(path), tokenizer)
    train, _ = build_prompt_sets(file_cfg(path, skip_bad_rows=True), tokenizer)
    assert [p.uid for p in train] == ["gaps.jsonl:1", "gaps.jsonl:5"]
    assert train.skipped_rows == 2
    assert train.stats["skipped_by_reason"] == {"wrong type": 1, "missing field": 1}
    assert PromptSampler(train, 0).skipped_rows == 2


def test_bad_parquet_row(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "b.parquet", [{"prompt": "a?", "answer": "1"},
                                                  {"prompt": None, "answer": "2"},
                                                  {"prompt": "c?", "answer": None}])
    with pytest.raises(DataError, match=r"b\.parquet, line 2, field 'prompt': missing"):
        build_prompt_sets(file_cfg(path, "parquet"), tokenizer)
    train, _ = build_prompt_sets(file_cfg(path, "parquet", skip_bad_rows=True), tokenizer)
    assert [p.uid for p in train] == ["b.parquet:1"] and train.skipped_rows == 2


def test_missing_file_and_all_rows_bad(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_prompt_sets(file_cfg(tmp_path / "nope.jsonl"), tokenizer)
    path = write_jsonl(tmp_path / "allbad.jsonl", [{"x": 1}, {"y": 2}])
    with pytest.raises(DataError, match="no usable rows"):
        build_prompt_sets(file_cfg(path, skip_bad_rows=True), tokenizer)


# ----------------------------------------------------------------------------- sampler


def fake_prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"p:{i}", messages=[], token_ids=[i], answer=str(i), entry=None,
                   task=None) for i in range(n)]


def uids(batch):
    return [p.uid for p in batch]


def test_sampler_deterministic_and_reshuffles_per_epoch():
    prompts = fake_prompts(10)
    a, b = PromptSampler(prompts, seed=3), PromptSampler(prompts, seed=3)
    assert uids(a.next_batch(25)) == uids(b.next_batch(25))
    s = PromptSampler(prompts, seed=3)
    epochs = [uids(s.next_batch(10)) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == sorted(uids(prompts))  # each epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != uids(prompts)
    assert s.epoch == 3 and s.position == 0
    other = PromptSampler(prompts, seed=4)
    assert uids(other.next_batch(10)) != epochs[0]
    # batches that straddle epochs continue the same sequence
    t = PromptSampler(prompts, seed=3)
    assert sum((uids(t.next_batch(n)) for n in (3, 9, 7, 11)), []) == sum(epochs, [])
    with pytest.raises(ValueError):
        t.next_batch(0)
    with pytest.raises(ValueError):
        PromptSampler([], seed=0)


def test_sampler_resumes_exactly():
    prompts = fake_prompts(7)
    ref = PromptSampler(prompts, seed=11)
    expected = [uids(ref.next_batch(3)) for _ in range(10)]
    s = PromptSampler(prompts, seed=11)
    got = [uids(s.next_batch(3)) for _ in range(4)]
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    assert {"epoch", "position", "seed", "size"} <= set(state)
    assert state["size"] == 7 and state["seed"] == 11 and state["epoch"] == 1
    resumed = PromptSampler(prompts, seed=11)
    resumed.load_state_dict(state)
    got += [uids(resumed.next_batch(3)) for _ in range(6)]
    assert got == expected
    assert resumed.stats["served"] == 30


def test_sampler_refuses_mismatched_state():
    s = PromptSampler(fake_prompts(7), seed=11)
    s.next_batch(5)
    state = s.state_dict()
    with pytest.raises(ValueError, match="saved with 7 prompts, this run has 8"):
        PromptSampler(fake_prompts(8), seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with seed 11, this run uses 12"):
        PromptSampler(fake_prompts(7), seed=12).load_state_dict(state)
    changed = [replace(p, answer="x") for p in fake_prompts(7)]
    with pytest.raises(ValueError, match="prompts differ"):
        PromptSampler(changed, seed=11).load_state_dict(state)
    lenient = PromptSampler(changed, seed=11)
    lenient.load_state_dict(state, strict=False)
    assert (lenient.epoch, lenient.position) == (0, 5)
    with pytest.raises(ValueError, match="lacks"):
        lenient.load_state_dict({"epoch": 0})


# ----------------------------------------------------------------------------- verifiers


def file_prompt(answer: str) -> Prompt:
    return Prompt(uid="f:1", messages=[{"role": "user", "content": "q"}], token_ids=[1],
                  answer=answer, entry={"prompt": "q", "answer": answer}, task=None)


@pytest.fixture(scope="module")
def rg_prompts(tokenizer):
    train, _ = build_prompt_sets(rg_cfg(train_size=4, eval_size=0), tokenizer)
    return train


def test_reasoning_gym_verifier(rg_prompts):
    v = Verifier(RewardConfig(), rg_cfg())
    p = rg_prompts[0]
    assert v.verifier_for(p) == "reasoning_gym"
    right = v.score(p, f"Steps...\n<answer>{p.answer}</answer>")
    assert right == RewardResult(reward=1.0, score=1.0, correct=True, format_ok=True,
                                 answer=p.answer)
    wrong_answer = str(int(p.answer) + 1)
    wrong = v.score(p, f"So the result is {wrong_answer}.")
    assert (wrong.score, wrong.correct, wrong.answer) == (0.0, False, wrong_answer)
    none = v.score(p, "I do not know.")
    assert (none.reward, none.answer, none.correct) == (0.0, None, False)
    # reasoning-gym's own partial credit: the reference inside a longer answer
    partial = v.score(p, f"<answer>{p.answer}0</answer>")
    assert 0 < partial.score < 1 and not partial.correct
    many = v.score_many(list(rg_prompts), [f"= {q.answer}" for q in rg_prompts])
    assert all(r.correct for r in many)


def test_math_verifier_equivalences():
    v = Verifier(RewardConfig(verifier="math"), rg_cfg())
    cases = [
        ("0.5", "Thus \\boxed{\\frac{1}{2}}.", True),
        ("1/2", "The answer is \\boxed{0.5}", True),
        ("\\frac{1}{2}", "<answer>1/2</answer>", True),
        ("0.5", "<answer>$\\dfrac{2}{4}$</answer>", True),
        ("2^{10}", "\\boxed{1024}", True),
        ("\\sqrt{2}", "<answer>2^{1/2}</answer>", True),
        ("1200", "so 1,200", True),
        ("0.5", "\\boxed{0.4}", False),
        ("3", "\\boxed{\\frac{1}{3}}", False),
        ("0.5", "no idea", False),
    ]
    results = v.score_many([file_prompt(ref) for ref, _, _ in cases], [r for _, r, _ in cases])
    assert [r.correct for r in results] == [ok for _, _, ok in cases]
    assert [r.score for r in results] == [float(ok) for _, _, ok in cases]
    assert v.verifier_for(file_prompt("1")) == "math" and v.timeouts == 0


def test_math_verifier_auto_for_files_and_unparseable_reference():
    v = Verifier(RewardConfig(), file_cfg("x.jsonl"))
    assert v.verifier_for(file_prompt("1")) == "math"
    assert v.score(file_prompt("Paris"), "<answer>paris</answer>").correct
    assert not v.score(file_prompt("Paris"), "<answer>Rome</answer>").correct


def test_math_verifier_works_off_the_main_thread():
    v = Verifier(RewardConfig(verifier="math"), rg_cfg())
    out, errors = [], []

    def run():
        try:
            out.append(v.score(file_prompt("0.5"), "\\boxed{\\frac{1}{2}}"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not errors and out[0].correct


def test_math_verifier_timeout_scores_zero(monkeypatch):
    real = rewards_mod._math_equal

    def slow(reference, answer):
        if answer == "slow":
            time.sleep(3)
        return real(reference, answer)

    monkeypatch.setattr(rewards_mod, "_math_equal", slow)
    v = Verifier(RewardConfig(verifier="math", timeout_seconds=0.3), rg_cfg())
    start = time.monotonic()
    res = v.score_many([file_prompt("1")] * 3, ["<answer>slow</answer>", "\\boxed{1}",
                                                "\\boxed{2}"])
    assert time.monotonic() - start < 2.5
    assert [r.score for r in res] == [0.0, 1.0, 0.0]
    assert res[0].timed_out and not res[1].timed_out and v.timeouts == 1
    assert v.score(file_prompt("1"), "\\boxed{1}").correct  # the fresh pool works


def test_exact_verifier():
    v = Verifier(RewardConfig(verifier="exact"), file_cfg("x.jsonl"))
    assert v.score(file_prompt("1200"), "total: 1,200.00").correct
    assert v.score(file_prompt("Paris"), "<answer>  paris </answer>").correct
    assert v.score(file_prompt("0.5"), "<answer>0.50</answer>").correct
    assert not v.score(file_prompt("0.5"), "<answer>1/2</answer>").correct
    assert normalize_exact(" New   York ") == "new york" and normalize_exact("-0.0") == "0"
    from megatron_tlt.config import Config
    from megatron_tlt.validation import RULES

    with pytest.raises(ConfigError, match="needs data.source=reasoning_gym"):
        RULES["reward_settings"](Config(reward=RewardConfig(verifier="reasoning_gym"),
                                        data=file_cfg("x.jsonl")), None, 1)


def test_extraction_modes():
    text = ("First 3 + 4 = 7, so \\boxed{\\frac{7}{2}} is wrong...\n"
            "<answer>12</answer> hmm <answer> 7 </answer>\nFinal: 8\n\n")
    assert extract(text, "answer_tag") == "7"
    assert extract(text, "boxed") == "\\frac{7}{2}"
    assert extract(text, "last_number") == "8"
    assert extract(text, "last_line") == "Final: 8"
    assert extract(text, "auto") == "7"
    no_tag = "so \\boxed{x^{2}} and later 5"
    assert extract(no_tag, "auto") == "x^{2}"
    assert extract("result 1,250.0 and -3", "auto") == "-3"
    assert extract("7-3", "last_number") == "3"
    assert extract("nothing here", "auto") is None
    assert extract("\\boxed{unclosed", "boxed") is None
    assert extract("", "last_line") is None
    with pytest.raises(ValueError, match="unknown answer extraction"):
        extract("x", "first_word")
    v = Verifier(RewardConfig(verifier="exact", answer_extraction="last_line"),
                 file_cfg("x.jsonl"))
    assert v.score(file_prompt("Final: 8"), text).correct


def test_format_reward_and_threshold(rg_prompts):
    p = rg_prompts[0]
    cfg = RewardConfig(format_reward=0.2, correct_threshold=0.5)
    v = Verifier(cfg, rg_cfg())
    tagged = v.score(p, f"<answer>{p.answer}</answer>")
    assert tagged.reward == pytest.approx(1.2) and tagged.format_ok and tagged.correct
    bare = v.score(p, f"It is {p.answer}")
    assert bare.reward == 1.0 and not bare.format_ok and bare.correct
    wrong_tagged = v.score(p, "<answer>\nnope\n</answer>")  # DOTALL: spans lines
    assert wrong_tagged.format_ok and wrong_tagged.reward == pytest.approx(0.2)
    assert not wrong_tagged.correct
    custom = Verifier(RewardConfig(format_reward=0.5, format_pattern=r"^Steps:.*=\s*-?\d+$"),
                      rg_cfg())
    assert custom.score(p, "Steps:\n1 + 1\n= 2").format_ok
