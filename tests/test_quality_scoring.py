"""The quality benchmark's scoring (`benchmarks/quality.py`), not its timings: a wrong
answer scores 0, an exact one 1, normalisation (case, thousands separators, dashes, whole
words); every question's fact is in its reference answer and its evidence in its document; and,
on the real model in HF transformers (no vLLM, no training), a reference answer is more likely
under the right document's first-k KV than under the other document's (swapped cartridges score
lower). Seconds: one 135M model, a few forward passes of ~300 tokens.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness.quality as Q  # noqa: E402


def test_wrong_answer_scores_zero_exact_one():
    assert Q.score_answers(["1893"], ["It was founded in 1893."]) == 1.0
    assert Q.score_answers(["1893"], ["It was founded in 1898."]) == 0.0
    assert Q.score_answers(["Quellport", "1893"], ["Quellport", "in 1901"]) == 0.5
    assert Q.score_answers([], []) == 0.0
    with pytest.raises(ValueError):
        Q.score_answers(["a"], [])


@pytest.mark.parametrize("fact, answer, found", [
    ("Quellport", "QUELLPORT, a harbour town", True),          # case
    ("1850", "He raised 1,850 pounds.", True),                  # thousands separator
    ("9316", "9 316 passengers", True),
    ("1850", "1,8500 pounds", False),
    ("forty-seven|47", "It took forty\u2013seven minutes", True),  # dash variants, alternatives
    ("forty-seven|47", "47 minutes", True),
    ("9", "in 19 days", False),                                 # whole words only
    ("Voss", "Hadley Vossberg", False),
    ("4.80", "It costs 4.80 pounds.", True),
    ("4.80", "It costs 4.8 pounds.", False),
    ("Steady across", "the motto \u201cSteady   across\u201d", True),  # whitespace, quotes
    ("Tervel Holm", "Tervel\nHolm", True),
    ("Marisande", "", False),
])
def test_fact_normalisation(fact, answer, found):
    assert Q.fact_found(fact, answer) is found


def test_questions_and_documents_agree():
    qs = Q.load_questions()
    assert len({q.id for q in qs}) == len(qs)
    a = [q for q in qs if q.doc == "a"]
    assert len(a) >= 30 and {q.split for q in qs} == {"heldout", "dev"}
    for q in qs:
        assert q.evidence in Q.document(q.doc), q.id
        assert Q.fact_found(q.fact, q.evidence), q.id        # the evidence states the fact
        assert Q.fact_found(q.fact, q.answer), q.id          # the reference answer states it
        assert Q.fact_span(q.answer, q.fact) is not None, q.id
    assert Q.spread(list(range(10)), 3) == [0, 4, 9] and Q.spread([1, 2], 0) == [1, 2]


@pytest.fixture(scope="module")
def real_model():
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.realmodel import ensure_real_model

    return load_model(ensure_real_model())


def test_right_cartridge_scores_higher_than_swapped(real_model):
    """First-k KV of 256 tokens of each document, computed by HF; the questions whose fact lies
    in document A's first 256 tokens: the reference answers' log-likelihood (and each fact's) is
    higher after A's KV than after B's, with the prompt the gateway builds after a first-k
    cartridge."""
    from lmcache_cartridge.api.prompts import PromptBuilder
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv
    from lmcache_cartridge.tools.create import document_tokens

    model, tok = real_model
    pb = PromptBuilder(tok)
    kv = {}
    for doc in ("a", "b"):
        head, body = document_tokens(tok, Q.document(doc))
        kv[doc] = compute_prefix_kv(model, (head + body)[:256])
    doc_a = Q.document("a")
    qs = [q for q in Q.load_questions() if q.doc == "a" and Q.evidence_position(tok, doc_a, q.evidence) < 200][:4]
    assert len(qs) == 4
    right, swapped = [], []
    for q in qs:
        ids = pb.chat_ids([{"role": "user", "content": q.question}], [0] * 256)[256:]
        right.append(Q.reference_loglik(model, tok, kv["a"], ids, q.answer, q.fact))
        swapped.append(Q.reference_loglik(model, tok, kv["b"], ids, q.answer, q.fact))
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    print(f"\n[quality scoring] mean LL answer right {mean(right, 'll_answer'):.3f} "
          f"swapped {mean(swapped, 'll_answer'):.3f}; "
          f"fact right {mean(right, 'll_fact'):.3f} swapped {mean(swapped, 'll_fact'):.3f}")
    assert mean(right, "ll_answer") > mean(swapped, "ll_answer") + 0.2
    assert mean(right, "ll_fact") > mean(swapped, "ll_fact") + 0.5
    assert sum(r["ll_fact"] > s["ll_fact"] for r, s in zip(right, swapped)) >= 3


def test_the_benchmarks_run_the_cli_under_their_own_interpreter(tmp_path):
    """`quality*.py` start `train` as `harness.CLI`: this interpreter and the package's module, so
    they also run where the package is only on PYTHONPATH, with no `lmcache-cartridge` script (the
    CUDA box). An empty PATH proves no console script is looked up."""
    import subprocess

    import harness

    assert harness.CLI[0] == sys.executable
    r = subprocess.run([*harness.CLI, "train", "--help"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": str(tmp_path)})
    assert r.returncode == 0 and "--conversations" in r.stdout, r.stderr


def test_scale_arms_are_named_by_the_conversations_they_train_on():
    """`quality_scale.py`: conversations drawn with another answer length are another arm, with
    its own cartridge, its own data to reuse and its own coverage section, so a run with
    `--answer-tokens 256` never reports the 64-token cartridge already in the work directory."""
    import quality_scale as S

    assert S.run_name(256, 8192, "constant") == "tr256_n8192"          # the curve's names stay
    assert S.run_name(512, 8192, "cosine") == "tr512_n8192_cos"
    assert S.run_name(256, 2048, "constant", 256) == "tr256_n2048_a256"
    assert S.run_name(512, 2048, "cosine", 256) == "tr512_n2048_a256_cos"
    assert S.run_name(256, 2048, "constant", S.ANSWER_TOKENS) != S.run_name(256, 2048, "constant", 256)
    assert S.run_name(256, 1024, "constant", autocast="bfloat16") == "tr256_n1024_bf16"
    assert S.run_name(256, 2048, "constant", 256, trim_repeats=16) == "tr256_n2048_a256_t16"
    qs = ("summarization", "question")
    assert S.run_name(256, 2048, "constant", seed_types=qs) == "tr256_n2048_seeds-su-qu"
    assert S.run_name(256, 2048, "constant", seed_types=S.SEED_TYPES) == "tr256_n2048"
    assert S.run_name(256, 2048, "constant", seed_types=qs, lr=4e-3) == "tr256_n2048_seeds-su-qu_lr0.004"
    assert S.run_name(256, 2048, "constant", lr=2e-3) == "tr256_n2048"
    assert S.run_name(256, 2048, "constant", lr=2e-2, batch_size=64) == "tr256_n2048_lr0.02_b64"
    assert S.run_name(256, 2048, "constant", batch_size=S.BATCH) == "tr256_n2048"
    assert S.run_name(256, 2048, "constant", question_loss=False) == "tr256_n2048_ans"
    assert S.run_name(256, 1024, "constant", lr=8e-3, anchor=10.0) == "tr256_n1024_lr0.008_anc10"
    assert S.run_name(256, 1024, "constant", anchor=0.0) == "tr256_n1024"
    assert S.run_name(512, 2048, "constant", init="attention") == "tr512_n2048_attn"
    assert S.run_name(512, 2048, "constant", init="first_k") == "tr512_n2048"
    assert S.run_name(512, 2048, "constant", init="attention", init_first=256) == "tr512_n2048_attn256"
    assert S.run_name(512, 2048, "constant", init="attention", init_first=256, frozen=256, epochs=2) == (
        "tr512_n2048_attn256_f256_e2")
    assert S.run_name(512, 2048, "constant", frozen=1) == "tr512_n2048"  # the attention sink: the curve's
    assert S.scale_key(2048, 256, qs) == "2048_a256_seeds-su-qu"
    assert S.scale_key(2048, S.ANSWER_TOKENS, windows=S.WINDOWS) == "2048"
    assert S.run_name(256, 2048, "constant", windows=(128, 256)) == "tr256_n2048_w128-256"
    tiled = S.build_parser().parse_args(["--window-placement", "tile"])
    assert S.windows(tiled) == (*S.WINDOWS, "tile") and S.windows(S.build_parser().parse_args([])) == S.WINDOWS
    assert S.run_name(512, 2048, "constant", windows=S.windows(tiled)) == "tr512_n2048_tile"
    assert S.data_run(2048, tiled) == "tr256_n2048_tile" and S.scale_title("2048_tile") == (
        "2048 conversations, windows tiling the document")
    # Another seed is another draw of conversations: its own names, data and coverage.
    drawn = S.build_parser().parse_args(["--window-placement", "tile", "--seed", "1"])
    assert S.run_name(512, 2048, "constant", windows=S.windows(tiled), epochs=3, seed=1) == "tr512_n2048_tile_s1_e3"
    assert S.data_run(2048, drawn) == "tr256_n2048_tile_s1" and S.scale_title("2048_tile_s1") == (
        "2048 conversations, windows tiling the document, seed 1")
    assert S.coverage_key("tr512_n2048_tile_s1", 2048, drawn, {"2048_tile": {}}) == "2048_tile_s1"
    # A run that synthesised its own conversations (512 tokens only) reports their coverage
    # once; the data run's report replaces any other's.
    assert S.coverage_key("tr512_n2048_tile", 2048, tiled, {"2048": {}}) == "2048_tile"
    assert S.coverage_key("tr512_n2048_tile", 2048, tiled, {"2048_tile": {}}) is None
    assert S.coverage_key("tr256_n2048_tile", 2048, tiled, {"2048_tile": {}}) == "2048_tile"
    assert S.scale_title("2048_a256_w128-256_seeds-su-qu") == (
        "2048 conversations, answers up to 256 tokens, windows of 128-256 tokens, seed types summarization, question")
    cov = {"facts": {"a16": {"bucket": ">=512", "split": "dev", "in_window": 3, "question": 1, "answer": 2}}}
    md = S.markdown({"meta": {"command": "c", "machine": {}, "lr": 2e-3, "batch_size": 8}, "arms": {},
                     "coverage": {"2048_a256": cov, "1024": cov, "128": cov, "2048_seeds-su-qu": cov}})
    titles = [line for line in md.splitlines() if line.startswith("## Coverage")]
    assert titles == ["## Coverage at 128 conversations (facts beyond 512 tokens)",
                      "## Coverage at 1024 conversations (facts beyond 512 tokens)",
                      "## Coverage at 2048 conversations, answers up to 256 tokens (facts beyond 512 tokens)",
                      "## Coverage at 2048 conversations, seed types summarization, question "
                      "(facts beyond 512 tokens)"]


def test_a_run_reuses_the_conversations_of_any_run_on_the_same_data(tmp_path):
    """`quality_scale.train` copies the conversations of a run on the same data (same scale,
    answer length, windows, seed types; any rate, anchor, batch, schedule) and never those of a
    run on other data, so `--lr 8e-3` then `--lr 8e-3 --anchor 10` synthesise once."""
    import quality_scale as S

    a = S.build_parser().parse_args(["--scales", "1024"])
    for name in ("tr256_n1024_a256", "tr256_n1024_seeds-su-qu_lr0.004", "tr256_n10240_lr0.008",
                 "tr256_n1024_w128-256"):  # other conversations
        (tmp_path / f"{name}.train").mkdir()
        (tmp_path / f"{name}.train" / "data.pt").write_text(name)
    assert S.data_of(tmp_path, 1024, a) is None
    (tmp_path / "tr256_n1024_lr0.008_b64.train").mkdir()
    assert S.data_of(tmp_path, 1024, a) is None  # a run dir without data yet
    (tmp_path / "tr256_n1024_lr0.008_b64.train" / "data.pt").write_text("same")
    assert S.data_of(tmp_path, 1024, a) == tmp_path / "tr256_n1024_lr0.008_b64.train" / "data.pt"
    a256 = S.build_parser().parse_args(["--scales", "1024", "--answer-tokens", "256"])
    assert S.data_of(tmp_path, 1024, a256).read_text() == "tr256_n1024_a256"
    (tmp_path / "tr256_n1024.train").mkdir()
    (tmp_path / "tr256_n1024.train" / "data.pt").write_text("the data run's")
    assert S.data_of(tmp_path, 1024, a).read_text() == "the data run's"  # the data run's first


def test_a_run_from_the_attention_start_or_of_more_epochs_lends_its_conversations(tmp_path):
    """The start, frozen positions and epochs change training only: a run named `_attn256`,
    `_f256` or `_e2` holds the same conversations as the data run, so another run on them copies
    rather than synthesises."""
    import quality_scale as S

    a = S.build_parser().parse_args(["--scales", "2048", "--window-placement", "tile"])
    for name in ("tr512_n2048_tile_attn256", "tr512_n2048_attn256_e2", "tr512_n2048_w128-256_attn256_f256"):
        (tmp_path / f"{name}.train").mkdir()
        (tmp_path / f"{name}.train" / "data.pt").write_text(name)
    assert S.data_of(tmp_path, 2048, a).read_text() == "tr512_n2048_tile_attn256"
    even = S.build_parser().parse_args(["--scales", "2048"])
    assert S.data_of(tmp_path, 2048, even).read_text() == "tr512_n2048_attn256_e2"
    short = S.build_parser().parse_args(["--window-min", "128", "--window-max", "256"])
    assert S.data_of(tmp_path, 2048, short).read_text() == "tr512_n2048_w128-256_attn256_f256"
    # another seed draws its own conversations: none of seed 0's are lent to it
    assert S.data_of(tmp_path, 2048, S.build_parser().parse_args(["--window-placement", "tile", "--seed", "1"])) is None
    (tmp_path / "tr512_n2048_tile_s1_attn256_e3.train").mkdir()
    (tmp_path / "tr512_n2048_tile_s1_attn256_e3.train" / "data.pt").write_text("seed 1's")
    assert S.data_of(tmp_path, 2048, S.build_parser().parse_args(
        ["--window-placement", "tile", "--seed", "1"])).read_text() == "seed 1's"
    assert S.data_of(tmp_path, 2048, a).read_text() == "tr512_n2048_tile_attn256"


def test_more_epochs_continue_the_one_epoch_run_at_a_constant_rate(tmp_path):
    """`--epochs 2` names its run `_e2` and starts from the one-epoch run's last checkpoint (train
    resumes a work directory whose steps grew), keeping that run's training time; `--epochs 3`
    from the two-epoch run's; a cosine schedule depends on the steps in all, so it starts over."""
    import quality_scale as S

    a = S.build_parser().parse_args(["--scales", "2048", "--tokens", "512", "--epochs", "2"])
    name = S.run_name(512, 2048, "constant", epochs=2)
    assert name == "tr512_n2048_e2" and S.run_name(512, 2048, "constant", epochs=1) == "tr512_n2048"
    src = tmp_path / "tr512_n2048.train"
    src.mkdir()
    for f, body in (("data.pt", "d"), ("checkpoint.pt", "step 256"), ("metrics.jsonl", "{}"), ("wall_s", "900.0")):
        (src / f).write_text(body)
    work = tmp_path / f"{name}.train"
    S.continue_run(tmp_path, name, work, a)
    assert (work / "checkpoint.pt").read_text() == "step 256" and (work / "wall_before_s").read_text() == "900.0"
    (work / "checkpoint.pt").write_text("step 300")
    S.continue_run(tmp_path, name, work, a)  # its own checkpoint is never replaced
    assert (work / "checkpoint.pt").read_text() == "step 300"
    (work / "wall_s").write_text("100.0")
    a3 = S.build_parser().parse_args(["--scales", "2048", "--tokens", "512", "--epochs", "3"])
    S.continue_run(tmp_path, "tr512_n2048_e3", tmp_path / "three.train", a3)  # from the two-epoch run
    assert (tmp_path / "three.train" / "checkpoint.pt").read_text() == "step 300"
    assert (tmp_path / "three.train" / "wall_before_s").read_text() == "1000.0"
    cos = S.build_parser().parse_args(["--scales", "2048", "--epochs", "2", "--lr-schedule", "cosine"])
    S.continue_run(tmp_path, "tr512_n2048_cos_e2", tmp_path / "cos.train", cos)
    assert not (tmp_path / "cos.train").exists()


def test_every_trained_size_has_its_first_k_baseline_and_each_arm_its_cartridge():
    """`--tokens 1024` adds the first-k 1024 baseline beside 256 and 512; an arm's name says which
    cartridge it answers from, the baselines' registered ids map to their directories, and a
    trained run's name is its own directory."""
    import quality_scale as S

    assert S.first_k_sizes(S.build_parser().parse_args([])) == (256, 512)
    assert S.first_k_sizes(S.build_parser().parse_args(["--tokens", "1024", "256"])) == (256, 512, 1024)
    assert S.arm_source("first_k_1024") == ("first_k", "qa-fk1024")
    assert S.arm_source("init_256") == ("trained", "qa-init256")
    assert S.arm_source("init_512_attn") == ("trained", "qa-init512-attn")
    assert Q._dir_of(S.arm_source("init_512_attn256")[1]) == "init512_attn256"
    assert S.attention_starts(S.build_parser().parse_args(["--tokens", "512", "--init", "attention"])) == (512,)
    assert S.attention_starts(S.build_parser().parse_args(["--tokens", "512"])) == ()
    assert S.arm_source("icl") == ("icl", None)
    assert S.arm_source("trained_1024_n2048_lr0.01") == ("trained", "tr1024_n2048_lr0.01")
    assert [Q._dir_of(c) for c in ("qa-fk1024", "qa-init256", "qa-tr512", "qb-tr256", "tr1024_n2048",
                                   "qa-init512-attn")] == \
        ["fk1024", "init256", "tr512", "trb256", "tr1024_n2048", "init512_attn"]


def test_scale_runs_side_by_side_keep_each_others_arms(tmp_path, monkeypatch):
    """A baseline asked while a long scale trains: both runs read the result before either
    wrote, and whichever saves last keeps the other's arm; an arm a run asks itself replaces
    the file's. (The model's answers are not under test here: `ask_all` returns fixed counts.)"""
    import quality_scale as S

    def answers(facts):
        return {"facts": [facts, 40], "dev": [0, 20], "heldout": [facts, 20],
                "by_position": {b: [0, 1] for b in S.BUCKETS}, "rows": []}

    asked = iter([3, 11, 5])
    monkeypatch.setattr(S, "ask_all", lambda *a, **k: answers(next(asked)))
    out = tmp_path / "scale"
    args = ["--scales", "--no-baselines", "--out", str(out)]
    long, short = (S.ScaleRun(S.build_parser().parse_args(args), args, tmp_path, tmp_path, []) for _ in "ab")
    for run in (long, short):
        run.model = run.tok = run.pb = run.pos = None
    short.probe("first_k_1024", None)
    long.probe("trained_512_n2048", None)
    saved = S.load_payload(out.with_suffix(".json"))["arms"]
    assert {n: r["facts"] for n, r in saved.items()} == {"first_k_1024": [3, 40], "trained_512_n2048": [11, 40]}
    long.probe("first_k_1024", None)  # asked again by this run: its own answer
    saved = S.load_payload(out.with_suffix(".json"))["arms"]
    assert {n: r["facts"] for n, r in saved.items()} == {"first_k_1024": [5, 40], "trained_512_n2048": [11, 40]}
    md = out.with_suffix(".md").read_text()
    assert "| first_k_1024 |" in md and "| trained_512_n2048 |" in md


def test_a_cartridge_trained_again_under_its_name_is_asked_again(tmp_path, monkeypatch):
    """A result kept from another machine's draw names a cartridge this work directory no longer
    holds: a run that trains the cartridge again asks it again; a run that finds the cartridge
    it asked does not. (`train` and `ask_all` stand in for training and the model's answers.)"""
    import json

    import quality_scale as S

    cart = tmp_path / "carts" / "tr512_n2048"
    cart.mkdir(parents=True)
    monkeypatch.setattr(S, "train", lambda *a, **k: (cart, {"steps": 256}))
    monkeypatch.setattr(S, "coverage_key", lambda *a, **k: None)
    asked = []
    monkeypatch.setattr(S, "ask_all", lambda *a, **k: asked.append(1) or {
        "facts": [len(asked), 40], "dev": [0, 20], "heldout": [len(asked), 20],
        "by_position": {b: [0, 1] for b in S.BUCKETS}, "rows": []})
    out = tmp_path / "scale"
    args = ["--scales", "2048", "--tokens", "512", "--no-baselines", "--out", str(out)]

    def run_once():
        run = S.ScaleRun(S.build_parser().parse_args(args), args, tmp_path, tmp_path / "carts", [])
        run.model = run.tok = run.pb = run.pos = None
        run.train_and_ask()
        return S.load_payload(out.with_suffix(".json"))["arms"]["trained_512_n2048"]

    (cart / "manifest.json").write_text(json.dumps({"content_hash": "one draw"}))
    S.write_result(S.Result(benchmark="quality_scale", machine={}, parameters={}, arms=[],
                            details={"arms": {"trained_512_n2048": {"facts": [13, 40], "rows": []}},
                                     "coverage": {}, "meta": {}}), out.parent, out.stem, body="")
    assert run_once()["facts"] == [1, 40] and len(asked) == 1  # no hash recorded: asked again
    assert run_once()["content_hash"] == "one draw" and len(asked) == 1  # the cartridge it asked: kept
    (cart / "manifest.json").write_text(json.dumps({"content_hash": "another draw"}))
    r = run_once()
    assert (r["facts"], r["content_hash"], len(asked)) == ([2, 40], "another draw", 2)


def test_scale_table_counts_the_facts_past_a_1024_token_window_apart():
    """The >=512 column says, in brackets, how many of its facts lie past 1,024 tokens and how
    many of those were stated (evidence positions from the run's meta); a result written
    without positions shows the plain count."""
    import quality_scale as S

    rows = [{"id": i, "split": "dev", "bucket": ">=512", "correct": c, "ll_fact": -1.0}
            for i, c in (("a20", True), ("a30", True), ("a31", False), ("a32", True))]
    arm = {"facts": [3, 4], "dev": [3, 4], "heldout": [0, 0], "rows": rows,
           "by_position": {"<256": [0, 0], "256-512": [0, 0], ">=512": [3, 4]}}
    meta = {"command": "c", "machine": {}, "evidence_positions": {"a20": 700, "a30": 1024, "a31": 1300, "a32": 1600}}
    cells = [line.split(" | ") for line in S.markdown({"meta": meta, "arms": {"icl": arm}}).splitlines()
             if line.startswith("| icl |")][0]
    assert cells[8] == "3/4 (2/3)"
    old = [line.split(" | ") for line in S.markdown({"meta": {**meta, "evidence_positions": None},
                                                     "arms": {"icl": arm}}).splitlines() if line.startswith("| icl")]
    assert old[0][8] == "3/4"


def test_a_served_cartridge_is_registered_from_the_directory_its_id_names(tmp_path):
    """The gateway is asked for a registered id; the scale's trained cartridges are registered
    as `train --id qa-<name>` in directory `<name>`: found by their manifest's id."""
    import json

    for d, cid in (("fk256", "qa-fk256"), ("tr1024_n2048", "qa-tr1024-n2048"), ("tr256_n2048", "qa-tr256-n2048")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "manifest.json").write_text(json.dumps({"cartridge_id": cid}))
    assert Q.cartridge_dir(tmp_path, "qa-fk256") == tmp_path / "fk256"
    assert Q.cartridge_dir(tmp_path, "qa-tr1024-n2048") == tmp_path / "tr1024_n2048"
    with pytest.raises(FileNotFoundError, match="qa-tr512-n2048"):
        Q.cartridge_dir(tmp_path, "qa-tr512-n2048")


def test_served_answers_are_scored_as_the_probe_and_their_disagreements_named():
    """`--serve`: a served answer is scored with the probe's scorer against the same fact; the
    questions where served and probe disagree are listed, and the table shows both counts."""
    import quality_scale as S

    qs = [q for q in Q.load_questions() if q.id in ("a01", "a02", "a30")]
    assert len(qs) == 3
    rows = [{"id": q.id, "split": q.split, "bucket": b, "correct": c, "text": "probe"}
            for q, b, c in zip(qs, ("<256", "<256", ">=512"), (True, False, False))]
    got = [{"id": qs[0].id, "text": f"It is {qs[0].fact.split('|')[0]}.", "arm_external_tokens": 1024},
           {"id": qs[1].id, "text": f"{qs[1].fact.split('|')[0]}", "arm_external_tokens": 1024},
           {"id": qs[2].id, "text": "I do not know.", "arm_external_tokens": 1024}]
    s = S.served_tally(rows, got, qs)
    assert s["facts"] == [2, 3] and s["by_position"]["<256"] == [2, 2] and s["by_position"][">=512"] == [0, 1]
    assert s["differ"] == [qs[1].id] and s["cartridge_tokens_loaded"] == 1024
    arm = {"facts": [1, 3], "dev": [0, 1], "heldout": [1, 2], "rows": rows,
           "by_position": {"<256": [1, 2], "256-512": [0, 0], ">=512": [0, 1]}, "served": {"mp": s}}
    md = S.markdown({"meta": {"command": "c", "machine": {}}, "arms": {"trained_1024_n2048": arm}})
    line = [x for x in md.splitlines() if x.startswith("| trained_1024_n2048 | mp |")][0]
    assert line.split(" | ")[2:4] == ["1/3", "2/3"] and f"| {qs[1].id} | 1,024 |" in line


def test_scale_table_gives_each_arm_the_kv_it_answers_from():
    """The memory side of the curve: a cartridge's KV is its length times the model's bytes per
    token, ICL's the whole document's; a result written before the column has it blank."""
    import quality_scale as S

    arm = {"facts": [1, 40], "dev": [0, 20], "heldout": [1, 20],
           "by_position": {b: [0, 1] for b in S.BUCKETS},
           "rows": [{"split": "dev", "bucket": "<256", "ll_fact": -1.0},
                    {"split": "dev", "bucket": "<256", "ll_fact": -2.0},
                    {"split": "heldout", "bucket": "<256", "ll_fact": -9.0}]}
    meta = {"command": "c", "machine": {}, "kv_bytes_per_token": 23040, "icl_tokens": 1766}
    md = S.markdown({"meta": meta, "arms": {n: arm for n in ("icl", "first_k_512", "trained_256_n1024_anc10")}})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in md.splitlines() if line.startswith("| ")}
    assert (rows["icl"], rows["first_k_512"], rows["trained_256_n1024_anc10"]) == ("38.8", "11.2", "5.6")
    assert "| -1.50 /  |" in md  # the dev split's facts only: the held-out row is not read
    old = S.markdown({"meta": {"command": "c", "machine": {}}, "arms": {"icl": arm}})
    assert "| icl |  |" in old


def test_coverage_by_seed_type_counts_dev_facts_beyond_the_window_only():
    """The per-seed-type coverage a choice of `--seed-types` may read: dev facts past 512 tokens,
    counted where the conversation's window held the evidence; a held-out fact, a fact inside the
    window's first 512 tokens and an answer whose window did not hold the evidence count nothing."""
    import quality_scale as S

    q = lambda i, split: Q.Question(i, "a", split, "?", "x", f"fact{i}", "e")  # noqa: E731
    qs = [q("d", "dev"), q("h", "heldout"), q("w", "dev")]
    pos = {"d": 600, "h": 600, "w": 100}
    data = [{"seed_type": "question", "window": [500, 700]},     # holds d (stated), h (stated), w (no)
            {"seed_type": "question", "window": [550, 650]},     # holds d, not stated
            {"seed_type": "creative", "window": [0, 300]},       # holds only w, stated
            {"seed_type": "creative", "window": [0, 300]}]       # says d's fact without its evidence
    answers = ["factd and facth", "nothing", "factw", "factd"]
    got = S.by_seed_type(data, answers, qs, pos)
    assert got["question"] == {"conversations": 2, "windows": 2, "answer": 1}
    assert got["creative"] == {"conversations": 2, "windows": 0, "answer": 0}
    assert got["structuring"] == {"conversations": 0, "windows": 0, "answer": 0}
    md = S.markdown({"meta": {"command": "c", "machine": {}, "lr": 2e-3, "batch_size": 8}, "arms": {},
                     "coverage": {"8192": {"facts": {}, "by_seed_type": got}}})
    assert "| question | 2 | 2 | 1 | 0.500 |" in md and "| structuring |" not in md


def test_a_coverage_report_is_kept_beside_its_data_and_read_back_without_it(tmp_path):
    """A scale trained on another machine (`gpu_scale.sh`) brings back its coverage report, not
    its conversations: the report is written beside `data.pt` once and read from there after."""
    import quality_scale as S
    import torch

    from lmcache_cartridge.tools.testmodel import ensure_test_model
    from lmcache_cartridge.tools.selfstudy.run import load_tokenizer

    tok = load_tokenizer(ensure_test_model())
    qs = [Q.Question("d", "a", "dev", "?", "x", "Morrow Bay", "e")]
    pos = {"d": 600}
    data_pt = tmp_path / "run.train" / "data.pt"
    data_pt.parent.mkdir()
    answer = tok("It went to Morrow Bay.", add_special_tokens=False)["input_ids"]
    torch.save({"train": [{"seed_type": "question", "window": [500, 700], "question": "Where?", "answer": answer},
                          {"seed_type": "creative", "window": [0, 300], "question": "Morrow Bay?", "answer": []}]},
               data_pt)
    report = S.coverage(tok, data_pt, qs, pos)
    assert report["conversations"] == 2
    assert report["facts"]["d"] == {"bucket": ">=512", "split": "dev", "in_window": 1, "question": 1, "answer": 1}
    data_pt.unlink()  # the data stayed on the GPU machine; the report came back
    assert (data_pt.parent / S.COVERAGE_NAME).exists() and S.coverage(tok, data_pt, qs, pos) == report


def test_teacher_windows_hold_the_evidence_where_asked_and_stay_inside_the_document():
    import teacher_window as T

    n = 1000
    for length in (128, 256, 768):
        for pos in (0, 5, 500, 990, 999):
            for place in T.PLACES:
                lo, hi = T.window_for(n, pos, length, place)
                assert hi - lo == length and 0 <= lo and hi <= n and lo <= pos < hi
    assert T.window_for(n, 500, 128, 0.5) == (436, 564)   # the evidence in the middle
    assert T.window_for(n, 500, 128, 0.1) == (487, 615)   # near the start
    assert T.window_for(n, 10, 128, 0.9) == (0, 128)      # moved in at the document's start
    assert T.window_for(n, 995, 128, 0.1) == (872, 1000)  # and at its end
    assert T.window_for(n, 500, T.WHOLE, 0.5) == (0, n) == T.window_for(n, 500, 4096, 0.5)
