"""lze_trainer.data: source forms, column layouts, normalised schema, errors, and the sampler."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")
pytest.importorskip("reasoning_gym")

from lze_trainer.data import (  # noqa: E402
    DataSourceError, PromptSampler, after_last_hashes, decode_meta, encode_meta, last_boxed,
    load_prompts, parse_reasoning_gym_source, reduce_ground_truth,
)

SCHEMA = {"messages", "ground_truth", "data_source", "index", "meta"}
GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?",
     "answer": "12/60*50 = 10\n#### 10"},
    {"question": "What is 1,000 + 1?", "answer": "#### 1,001"},
]
MATH_ROWS = [
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{4}$.",
     "solution": "We get $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
     "level": "Level 1"},
    {"problem": "Solve $x^2 = 4$, $x > 0$.",
     "solution": "First \\boxed{-2} is wrong; $x = \\boxed{2}$.", "level": "Level 2"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def user_turn(row):
    return [m["content"] for m in row["messages"] if m["role"] == "user"][-1]


# --- local files and column layouts ------------------------------------------------------------


def test_gsm8k_parquet_layout(tmp_path):
    ds = load_prompts(write_parquet(tmp_path / "gsm8k_train.parquet", GSM8K_ROWS))
    assert set(ds.column_names) == SCHEMA and len(ds) == 3
    assert ds.features["index"].dtype == "int64"
    assert [row["ground_truth"] for row in ds] == ["72", "10", "1,001"]
    assert list(ds["index"]) == [0, 1, 2]
    assert set(ds["data_source"]) == {"gsm8k_train.parquet"} and set(ds["meta"]) == {"{}"}
    assert ds[0]["messages"] == [{"role": "user", "content": GSM8K_ROWS[0]["question"]}]


def test_math_jsonl_layout_takes_the_last_box(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "math.jsonl", MATH_ROWS))
    assert list(ds["ground_truth"]) == ["\\frac{3}{4}", "2"]
    assert user_turn(ds[1]) == MATH_ROWS[1]["problem"]


def test_answer_column_wins_over_solution_and_names_match_case_insensitively(tmp_path):
    rows = [{"ID": "2024-I-1", "Problem": "AIME problem", "Solution": "... \\boxed{204}",
             "Answer": 204}]
    ds = load_prompts(write_jsonl(tmp_path / "aime.jsonl", rows))
    assert ds[0]["ground_truth"] == "204" and user_turn(ds[0]) == "AIME problem"


def test_json_file_split_names_a_top_level_key(tmp_path):
    path = tmp_path / "splits.json"
    test_rows = [{"problem": "q0", "answer": "2"}, {"problem": "q1", "answer": "3"}]
    path.write_text(json.dumps({"train": [{"problem": "p0", "answer": "1"}], "test": test_rows}))
    ds = load_prompts(f"{path}?split=test")
    assert list(ds["ground_truth"]) == ["2", "3"] and user_turn(ds[1]) == "q1"
    with pytest.raises(DataSourceError, match="no top-level key 'dev'"):
        load_prompts(f"{path}?split=dev")


def test_verl_chat_layout_dapo(tmp_path):
    rows = [{
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Solve 2+2. The last line is 'Answer: $Answer'."}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "4", "style": "rule-lawyer"},
        "extra_info": {"index": "a1"},
    }]
    ds = load_prompts(write_parquet(tmp_path / "dapo.parquet", rows),
                      system_prompt="Be brief.", prompt_template="{question}\nThink first.")
    assert ds[0]["ground_truth"] == "4"
    assert ds[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Solve 2+2. The last line is 'Answer: $Answer'.\nThink first."}]


def test_template_keeps_latex_braces_and_system_prompt_replaces_the_source_one(tmp_path):
    template = "{question}\nPut the final answer in \\boxed{}."
    ds = load_prompts(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS[:1]), prompt_template=template,
                      system_prompt="You are a careful solver.")
    assert ds[0]["messages"] == [
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user",
         "content": GSM8K_ROWS[0]["question"] + "\nPut the final answer in \\boxed{}."}]
    chat = [{"prompt": [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}],
             "gold": "7"}]
    ds = load_prompts(write_jsonl(tmp_path / "chat.jsonl", chat), prompt_key="prompt",
                      answer_key="gold", system_prompt="new")
    assert ds[0]["messages"] == [{"role": "system", "content": "new"},
                                 {"role": "user", "content": "q"}]


def test_explicit_and_dotted_keys(tmp_path):
    rows = [{"q": "one", "labels": {"final": "#### 5", "other": 0}}]
    ds = load_prompts(write_jsonl(tmp_path / "custom.jsonl", rows), prompt_key="q",
                      answer_key="labels.final")
    assert ds[0]["ground_truth"] == "5" and user_turn(ds[0]) == "one"


def test_limit_keeps_the_first_rows_with_their_indices(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS), limit=2)
    assert list(ds["index"]) == [0, 1] and list(ds["ground_truth"]) == ["72", "10"]


# --- errors ------------------------------------------------------------------------------------


def test_unknown_layout_lists_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "x", "label": {"value": "1"}}])
    with pytest.raises(DataSourceError, match=r"odd\.jsonl.*prompt_key.*text, label \{value\}"):
        load_prompts(path)
    with pytest.raises(DataSourceError, match=r"answer_key='label\.missing' is not a column"):
        load_prompts(path, prompt_key="text", answer_key="label.missing")
    with pytest.raises(DataSourceError, match=r"prompt_key='question' is not a column.*text"):
        load_prompts(path, prompt_key="question", answer_key="label.value")


def test_bad_rows_name_the_row(tmp_path):
    rows = GSM8K_ROWS[:2] + [{"question": None, "answer": "#### 1"}]
    with pytest.raises(DataSourceError, match="row 2: column 'question' must hold text or a chat"):
        load_prompts(write_jsonl(tmp_path / "g.jsonl", rows))
    rows = [{"problem": "p", "answer": None}]
    with pytest.raises(DataSourceError, match="row 0: column 'answer' is empty"):
        load_prompts(write_jsonl(tmp_path / "a.jsonl", rows))


def test_empty_split(tmp_path):
    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"question": [], "answer": []},
                               features=datasets.Features({"question": datasets.Value("string"),
                                                           "answer": datasets.Value("string")})
                               ).to_parquet(str(path))
    with pytest.raises(DataSourceError, match="empty.parquet.*the split is empty"):
        load_prompts(str(path))


@pytest.mark.parametrize("source, message", [
    ("does/not/exist.parquet", "not found"),
    ("data.csv", "expected hf://owner/name"),
    ("s3://bucket/train.parquet", "unsupported address"),
    ("hf://", "name is missing"),
    ("hf://a/b/c", "expected a hub dataset id 'owner/name'"),
    ("https://huggingface.co/datasets/", "name is missing"),
    ("https://huggingface.co/datasets/openai/gsm8k/tree/main", "owner/name"),
    ("hf://openai/gsm8k?subset=main",
     "unknown query key 'subset'; expected one of config, split, revision"),
    ("hf://openai/gsm8k?split", "expected key=value"),
    ("hf://openai/gsm8k?split=train&split=test", "given twice"),
    ("reasoning-gym:?size=3", "name is missing"),
    ("reasoning-gym:basic_arithmetc",
     "unknown reasoning-gym task 'basic_arithmetc'; did you mean basic_arithmetic"),
    ("reasoning-gym:basic_arithmetic?depth=3", "no config field 'depth'.*min_terms"),
    ("reasoning-gym:basic_arithmetic?min_terms=two", "min_terms='two'"),
    ("reasoning-gym:basic_arithmetic?min_terms=1.5", "min_terms='1.5'.*int"),
    ("reasoning-gym:basic_arithmetic?allow_negation=maybe", "true or false"),
    ("reasoning-gym:basic_arithmetic?format_style=fancy", "one of \\['simple', 'natural'\\]"),
    ("reasoning-gym:basic_arithmetic?min_terms=5&max_terms=2",
     "rejected the config.*max_terms must be >= min_terms"),
    ("reasoning-gym:basic_arithmetic?operators=%5E", "unsupported operator"),
    ("reasoning-gym:basic_arithmetic?size=0", "empty"),
])
def test_bad_sources(tmp_path, monkeypatch, source, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(DataSourceError, match=message) as info:
        load_prompts(source)
    assert repr(source) in str(info.value)


def test_local_file_rejects_a_query(tmp_path):
    path = write_parquet(tmp_path / "g.parquet", GSM8K_ROWS)
    with pytest.raises(DataSourceError, match="unknown query key 'split'; expected no query"):
        load_prompts(f"{path}?split=train")


def test_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError, match="prompt_template must contain '{question}'"):
        load_prompts(path, prompt_template="Solve it.")
    with pytest.raises(ValueError, match="limit must be None or an int >= 1"):
        load_prompts(path, limit=0)
    with pytest.raises(DataSourceError, match="non-empty string"):
        load_prompts("  ")


# --- Hugging Face hub --------------------------------------------------------------------------


@pytest.fixture
def hub_offline(monkeypatch):
    """The hub unreachable, failing at once (no network retries)."""
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("source", ["hf://openai/gsm8k?config=main&split=train",
                                    "https://huggingface.co/datasets/openai/gsm8k?config=main"])
def test_unreachable_hub_says_how_to_precache(hub_offline, source):
    with pytest.raises(DataSourceError) as info:
        load_prompts(source)
    message = str(info.value)
    assert repr(source) in message and "cannot reach the Hugging Face hub" in message
    for advice in ("datasets.load_dataset('openai/gsm8k', 'main')",
                   "huggingface-cli download --repo-type dataset openai/gsm8k",
                   "HF_DATASETS_OFFLINE=1", "to_parquet"):
        assert advice in message


@pytest.mark.parametrize("source, expected", [
    ("hf://openai/gsm8k?config=main&split=test",
     (("openai/gsm8k",), {"name": "main", "split": "test", "revision": None})),
    ("hf://datasets/openai/gsm8k?config=main",
     (("openai/gsm8k",), {"name": "main", "split": "train", "revision": None})),
    ("https://huggingface.co/datasets/openai/gsm8k/?config=socratic&split=train&revision=abc",
     (("openai/gsm8k",), {"name": "socratic", "split": "train", "revision": "abc"})),
    ("hf://HuggingFaceH4/MATH-500?split=test",
     (("HuggingFaceH4/MATH-500",), {"name": None, "split": "test", "revision": None})),
])
def test_hub_arguments(monkeypatch, source, expected):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_prompts(source)
    assert calls == [expected]
    assert set(ds["data_source"]) == {expected[0][0]}
    assert list(ds["ground_truth"]) == ["72", "10", "1,001"]


def test_hub_config_errors_name_the_source(monkeypatch):
    def fake_load_dataset(*args, **kwargs):
        raise ValueError("BuilderConfig 'mian' not found. Available: ['main', 'socratic']")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(DataSourceError,
                       match=r"'hf://openai/gsm8k\?config=mian'.*Available: \['main'"):
        load_prompts("hf://openai/gsm8k?config=mian")


# --- reasoning-gym -----------------------------------------------------------------------------


@pytest.mark.parametrize("operators", ["+", "%2B"])
def test_reasoning_gym_plus_is_a_plus(operators):
    source = ("reasoning-gym:basic_arithmetic?size=40&seed=1&min_terms=2&max_terms=2"
              f"&min_digits=1&max_digits=2&operators={operators}")
    ds = load_prompts(source)
    assert len(ds) == 40 and list(ds["index"]) == list(range(40))
    assert set(ds["data_source"]) == {"reasoning-gym:basic_arithmetic"}
    for row in ds:
        meta = decode_meta(row["meta"])
        assert meta["source"] == source
        expression = meta["entry"]["metadata"]["expression"]
        assert set(re.findall(r"\s([-+*/])\s", expression)) == {"+"}  # binary operators
        assert row["ground_truth"] == meta["entry"]["answer"] == str(eval(expression))
        assert user_turn(row) == meta["entry"]["question"]


def test_reasoning_gym_is_deterministic_and_seeded():
    base = "reasoning-gym:basic_arithmetic?size=20&max_digits=3"
    first, again = load_prompts(base), load_prompts(base)
    assert first["messages"] == again["messages"]  # seed defaults to 0, not a random seed
    assert first["messages"] == load_prompts(base + "&seed=0")["messages"]
    assert first["messages"] != load_prompts(base + "&seed=1")["messages"]
    assert load_prompts(base, limit=5)["messages"] == first["messages"][:5]


def test_reasoning_gym_config_values_are_typed():
    task, config = parse_reasoning_gym_source(
        "reasoning-gym:basic_arithmetic?operators=+,*&allow_negation=false&format_style=natural"
        "&whitespace=no_space&seed=none&size=7")
    assert task == "basic_arithmetic"
    assert config == {"operators": ["+", "*"], "allow_negation": False, "format_style": "natural",
                      "whitespace": "no_space", "seed": None, "size": 7}
    _, config = parse_reasoning_gym_source('reasoning-gym:basic_arithmetic?operators=["-","/"]')
    assert config == {"operators": ["-", "/"], "seed": 0}
    _, config = parse_reasoning_gym_source("reasoning-gym:basic_arithmetic?operators=%20%2B")
    assert config["operators"] == [" +"]  # %20 is the space; '+' never is


def test_reasoning_gym_template_and_system_prompt():
    ds = load_prompts("reasoning-gym:basic_arithmetic?size=2", system_prompt="Use <answer> tags.",
                      prompt_template="Q: {question}")
    assert [m["role"] for m in ds[0]["messages"]] == ["system", "user"]
    assert user_turn(ds[0]).startswith("Q: ")
    assert ds[0]["messages"][0]["content"] == "Use <answer> tags."


# --- ground-truth extraction and metadata ------------------------------------------------------


@pytest.mark.parametrize("text, boxed", [
    ("\\boxed{5}", "5"),
    ("a \\boxed{1} b \\boxed{\\frac{1}{2}} c", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{x^{2}+\\sqrt{y}}", "x^{2}+\\sqrt{y}"),
    ("\\boxed 5$.", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed{3} then \\boxed{4", "3"),  # the last box is cut off: the last complete one counts
    ("no box", None),
    ("\\boxedx", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_ground_truth_reduction():
    assert after_last_hashes("steps\n#### 72\n") == "72"
    assert after_last_hashes("#### ") is None and after_last_hashes("72") is None
    assert reduce_ground_truth("...\n#### 1,000") == "1,000"
    assert reduce_ground_truth("so $\\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"
    assert reduce_ground_truth("  -3 ") == "-3"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12)


@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4))
@settings(max_examples=200, deadline=None)
def test_meta_round_trips_tuples(value):
    assert decode_meta(encode_meta(value)) == value
    assert decode_meta("{}") == {}


# --- PromptSampler -----------------------------------------------------------------------------


def draw_all(sampler, sizes):
    return [sampler.next(n) for n in sizes]


@given(num_rows=st.integers(1, 40), seed=st.integers(0, 2**32), shuffle=st.booleans(),
       data=st.data())
@settings(max_examples=150, deadline=None)
def test_sampler_epochs_are_permutations_and_draws_distinct(num_rows, seed, shuffle, data):
    sizes = data.draw(st.lists(st.integers(1, num_rows), min_size=1, max_size=12))
    sampler = PromptSampler(num_rows, seed=seed, shuffle=shuffle)
    assert sampler.epoch == 0
    draws = draw_all(sampler, sizes)
    for drawn in draws:
        assert len(set(drawn)) == len(drawn) and all(0 <= i < num_rows for i in drawn)
    stream = [i for drawn in draws for i in drawn]
    for start in range(0, len(stream) - num_rows + 1, num_rows):  # each epoch serves every row once
        assert sorted(stream[start:start + num_rows]) == list(range(num_rows))
    assert sampler.epoch == -(-len(stream) // num_rows)


@given(num_rows=st.integers(1, 30), seed=st.integers(0, 1000), data=st.data())
@settings(max_examples=100, deadline=None)
def test_sampler_resume_equals_uninterrupted(num_rows, seed, data):
    sizes = data.draw(st.lists(st.integers(1, num_rows), min_size=2, max_size=10))
    cut = data.draw(st.integers(1, len(sizes) - 1))
    full = PromptSampler(num_rows, seed)
    uninterrupted = draw_all(full, sizes)
    first = PromptSampler(num_rows, seed)
    head = draw_all(first, sizes[:cut])
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints may serialise it
    resumed = PromptSampler(num_rows, seed)
    resumed.load_state_dict(state)
    assert head + draw_all(resumed, sizes[cut:]) == uninterrupted
    assert resumed.state_dict() == full.state_dict() and resumed.epoch == full.epoch


def test_sampler_order_depends_on_seed_and_epoch():
    a, b = PromptSampler(100, seed=0), PromptSampler(100, seed=0)
    epoch1, epoch2 = a.next(100), a.next(100)
    assert epoch1 == b.next(100) and a.epoch == 2
    assert epoch1 != epoch2 and sorted(epoch1) == sorted(epoch2) == list(range(100))
    assert PromptSampler(100, seed=1).next(100) != epoch1
    assert PromptSampler(5, seed=0, shuffle=False).next(5) == [0, 1, 2, 3, 4]


def test_sampler_errors():
    with pytest.raises(ValueError, match="num_rows must be an int >= 1"):
        PromptSampler(0, seed=0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        PromptSampler(3, seed=-1)
    sampler = PromptSampler(3, seed=0)
    with pytest.raises(ValueError, match=r"n must be an int in \[1, num_rows=3\]"):
        sampler.next(4)
    with pytest.raises(ValueError, match="num_rows=4 does not match"):
        sampler.load_state_dict(PromptSampler(4, seed=0).state_dict())
    with pytest.raises(ValueError, match="seed=1 does not match"):
        sampler.load_state_dict(PromptSampler(3, seed=1).state_dict())


def test_held_out_rows_that_are_training_prompts_are_dropped():
    from lze_trainer.prompts import without_prompts_of

    def row(text, system=None):
        messages = ([{"role": "system", "content": system}] if system else [])
        return {"messages": messages + [{"role": "user", "content": text}]}

    train = [row("Calculate 1 + 2."), row("Calculate 3 + 4.", system="Be brief.")]
    held_out = [row("Calculate 1 + 2."), row("Calculate 3 + 4."), row("Calculate 5 + 6.")]
    # The same user text under another system prompt is another prompt.
    assert without_prompts_of(held_out, train) == held_out[1:]


def test_reasoning_gym_arithmetic_repeats_across_seeds():
    """Why the trainer drops held-out rows that are training prompts (data.eval_drop_train_prompts):
    small-number arithmetic repeats problems across seeds."""
    from lze_trainer.prompts import without_prompts_of

    spec = "reasoning-gym:basic_arithmetic?size={n}&seed={seed}&min_terms=2&max_terms=2&max_digits=1"
    train = load_prompts(spec.format(n=500, seed=1)).to_list()
    held_out = load_prompts(spec.format(n=100, seed=2)).to_list()
    assert len(without_prompts_of(held_out, train)) < len(held_out)
