"""Self-study synthesis: the plan both backends follow, question targets, resumable synthesis
(HF, fast), and the vLLM backend's teacher targets against HF's on the same conversations
(`slow`: starts a vLLM engine on the tiny test model).

The reference for vLLM's targets is independent of the backend under test: a plain HF forward
of the teacher's sequence (fp32), read at the positions `collate` picks for training.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmcache_cartridge.tools.selfstudy.config import LoopConfig, SynthConfig, TrainConfig
from lmcache_cartridge.tools.selfstudy.objective import answer_logprobs, collate, distill_loss
from lmcache_cartridge.tools.selfstudy.run import DATA_NAME, SHARDS_NAME, load_for_training, load_or_synthesize
from lmcache_cartridge.tools.selfstudy.synth import (
    HFBackend, ShardStore, plan, scored_prompt_tokens, synthesize, tiling,
)

from test_train import doc, one_thread  # noqa: E402,F401  (fixtures: the document; torch on one thread)

SYNTH = SynthConfig(window_min=128, window_max=256, question_tokens=16, answer_tokens=16, per_window=4)


@pytest.fixture(scope="module")
def hf(doc):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    return model_dir, model, tok


def test_window_starts_cover_the_document_evenly_both_ends_included():
    n, cfg = 1766, SynthConfig(window_min=384, window_max=768, per_window=8)
    specs = [plan(n, cfg, 0, "train", i, 128) for i in range(128)]
    groups = [specs[i:i + 8] for i in range(0, 128, 8)]
    assert all(len({s.window for s in g}) == 1 for g in groups)  # a group shares its window
    starts = [g[0].window[0] for g in groups]
    assert starts[0] == 0 and groups[-1][0].window[1] == n        # both ends
    fractions = [s / (n - (g[0].window[1] - g[0].window[0])) for s, g in zip(starts, groups)]
    assert max(abs(f - i / 15) for i, f in enumerate(fractions)) < 0.01  # evenly spread
    covered = [sum(s.window[0] <= t < s.window[1] for s in specs) for t in range(n)]
    assert min(covered) >= 8                                       # every token is in some window
    # A conversation's plan depends on (seed, tag, index, count) only; redraws wrap round.
    assert plan(n, cfg, 0, "train", 5, 128) == specs[5]
    assert plan(n, cfg, 0, "train", 128, 128).window == specs[0].window
    assert plan(n, cfg, 1, "train", 5, 128) != specs[5]


def test_tiled_windows_put_every_token_in_as_many_windows_the_ends_too():
    """`placement="tile"`: each cut of the document into consecutive windows of 384-768 tokens
    holds every token once, so after whole cuts every token is in as many windows; even starts
    leave the first and last token in one window where the middle is in several."""
    n, tile = 1766, SynthConfig(window_min=384, window_max=768, per_window=8, placement="tile")
    specs = [plan(n, tile, 0, "train", i, 96) for i in range(96)]      # 12 groups: 4 cuts of 3
    groups = [specs[i:i + 8] for i in range(0, 96, 8)]
    assert all(len({s.window for s in g}) == 1 for g in groups)
    windows = [g[0].window for g in groups]
    assert all(384 <= end - start <= 768 for start, end in windows)
    cuts = [sorted(windows[i:i + 3]) for i in range(0, 12, 3)]
    for cut in cuts:  # consecutive, from the first token to the last
        assert [w[0] for w in cut] == [0] + [w[1] for w in cut[:-1]] and cut[-1][1] == n
    assert len({tuple(c) for c in cuts}) == 4                              # each cut drawn anew
    assert [sum(s <= t < e for s, e in windows) for t in range(n)] == [4] * n
    even = [plan(n, replace(tile, placement="even"), 0, "train", i, 96).window for i in range(0, 96, 8)]
    covered = [sum(s <= t < e for s, e in even) for t in range(n)]
    assert covered[0] == covered[-1] == 1 < max(covered)
    assert plan(n, tile, 0, "train", 96, 96).window == windows[0]         # redraws wrap round
    # Documents shorter than a window, or than two, are cut into as few windows as fit.
    assert tiling(300, tile, 0) == [(0, 300)] and tiling(768, tile, 0) == [(0, 768)]
    assert all(384 <= e - s <= 768 for s, e in tiling(770, tile, 1)) and tiling(770, tile, 1)[-1][1] == 770


def test_question_targets_line_up_in_teacher_and_student(hf, doc):
    """With questions scored, teacher and student score the same tokens (the user turn, then the
    answer), and a plain HF forward of the teacher's sequence at the positions `collate` picks
    reproduces the stored targets; shifted by one it does not (the check can fail)."""
    _, model, tok = hf
    convs = synthesize(model, tok, doc.read_text(), SYNTH, count=4, seed=0, tag="t", progress=False)
    for c in convs:
        p = scored_prompt_tokens(c.teacher_prefix, c.student_prefix)
        assert 0 < p < len(c.student_prefix) and c.prompt_topk_ids.shape == (p, SYNTH.top_k)
        assert c.teacher_prefix[-p:] == c.student_prefix[-p:]
        assert tok.decode(c.student_prefix[-p:]).find(c.question[-8:]) >= 0  # the question is scored
    t = collate(convs, teacher=True, pad_id=tok.pad_token_id, device="cpu", questions=True)
    s = collate(convs, teacher=False, pad_id=tok.pad_token_id, device="cpu", questions=True)
    assert torch.equal(t.mask, s.mask) and torch.equal(t.topk_ids, s.topk_ids)
    # The token each scored position predicts is the same token in both sequences.
    nxt = lambda b: b.input_ids.gather(1, (b.positions + 1).clamp(max=b.input_ids.shape[1] - 1))  # noqa: E731
    last = [len(c.answer) for c in convs]  # the answer's last token is not in the input
    for b, c in enumerate(convs):
        n = int(t.mask[b].sum()) - 1
        assert torch.equal(nxt(t)[b, :n], nxt(s)[b, :n]), c.question
        assert nxt(t)[b, n - last[b] + 1:n].tolist() == c.answer[:-1][:n]
    with torch.no_grad():
        lp = answer_logprobs(model, t)
    kept = torch.isfinite(t.topk_logprobs) & t.mask.unsqueeze(-1)
    torch.testing.assert_close(lp.gather(-1, t.topk_ids)[kept], t.topk_logprobs[kept], rtol=1e-3, atol=1e-3)
    shifted = replace(t, positions=(t.positions - 1).clamp(min=0))
    with torch.no_grad():
        off = answer_logprobs(model, shifted).gather(-1, t.topk_ids)
    assert (off[kept] - t.topk_logprobs[kept]).abs().max() > 1.0
    # Answer-only scoring is the old objective, unchanged: a suffix of the question+answer span.
    a = collate(convs, teacher=False, pad_id=tok.pad_token_id, device="cpu", questions=False)
    assert int(a.mask.sum()) == sum(last) < int(s.mask.sum())
    with torch.no_grad():
        assert math.isfinite(float(distill_loss(answer_logprobs(model, s), s)))


class Stop(Exception):
    pass


class StopsAfter(HFBackend):
    """The real HF backend, stopped (as by a kill) after `calls` batches."""

    def __init__(self, model, tok, calls: int) -> None:
        super().__init__(model, tok)
        self.calls, self.seen = calls, []

    def run(self, body, cfg, specs, done=None):
        if len(self.seen) == self.calls:
            raise Stop
        self.seen.append([s.index for s in specs])
        return super().run(body, cfg, specs, done)


def test_a_stopped_synthesis_resumes_after_its_last_saved_batch(hf, doc, tmp_path):
    _, model, tok = hf
    text = doc.read_text()
    store = ShardStore(tmp_path / "synth", "fp")
    first = StopsAfter(model, tok, calls=1)
    first.batch = 3
    with pytest.raises(Stop):
        synthesize(first, tok, text, SYNTH, count=5, seed=0, tag="train", progress=False, store=store)
    again = StopsAfter(model, tok, calls=99)
    again.batch = 3
    resumed = synthesize(again, tok, text, SYNTH, count=5, seed=0, tag="train", progress=False, store=store)
    assert first.seen == [[0, 1, 2]] and again.seen[0][0] == 3  # the saved batch was not redone
    straight = synthesize(model, tok, text, SYNTH, count=5, seed=0, tag="train", progress=False)
    assert [c.question for c in resumed] == [c.question for c in straight]
    for a, b in zip(resumed, straight):
        assert a.answer == b.answer and torch.equal(a.topk_ids, b.topk_ids)
        assert torch.equal(a.prompt_topk_logprobs, b.prompt_topk_logprobs)
    # Other settings' shards are not used.
    assert ShardStore(tmp_path / "synth", "other").load("train") == ([], 0)


def test_vllm_flat_log_probs_read_back_as_its_per_position_dicts():
    """The synthesis asks vLLM for flat log-prob lists (far fewer objects in its frontend); the
    targets read from them are those read from the dicts vLLM makes otherwise, with vLLM's own
    writer filling both from the same rows (ties, and the chosen token below the top k)."""
    pytest.importorskip("vllm")
    from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position

    from lmcache_cartridge.tools.selfstudy.vllm_synth import _flat_logprobs, _rows

    assert _flat_logprobs() == {"flat_logprobs": True}  # this vLLM has them: the synthesis uses them
    k, g = 4, torch.Generator().manual_seed(0)
    dicts, flat = [None], FlatLogprobs()
    flat.append(None)  # as vLLM starts prompt log-probs: no row for the first token
    chosen = []
    for pos in range(12):
        top = torch.randperm(50, generator=g)[:k].tolist()
        lps = sorted(torch.randn(k, generator=g).tolist(), reverse=True)
        if pos % 3 == 0:
            lps[2] = lps[1]  # a bf16 tie
        own = top[pos % k] if pos % 2 else 60 + pos  # the position's token: in the top k, or below it
        own_lp = lps[pos % k] if pos % 2 else lps[-1] - 1.0
        chosen.append(own)
        for container in (dicts, flat):
            append_logprobs_for_next_position(container, [own, *top], [own_lp, *lps], [None] * (k + 1),
                                              (pos % k) + 1 if pos % 2 else k + 3, k)
    for a, b in ((dicts[1:], flat[1:]), (dicts[5:], flat[5:])):
        ids_d, lps_d = _rows(list(a), k, chosen[-len(a):])
        ids_f, lps_f = _rows(list(b), k, chosen[-len(b):])
        assert torch.equal(ids_d, ids_f) and torch.equal(lps_d, lps_f)


def test_the_students_prompt_builder_is_made_once_per_tokenizer(hf):
    from lmcache_cartridge.api.prompts import PromptBuilder
    from lmcache_cartridge.tools.selfstudy.synth import _BUILDERS, student_prompt_ids

    _, _, tok = hf
    user = {"role": "user", "content": "What is the ferry called?"}
    first = student_prompt_ids(tok, user)
    builder = _BUILDERS[tok]
    assert student_prompt_ids(tok, user) == first == PromptBuilder(tok).chat_ids([user], (), after_trained=True)
    assert _BUILDERS[tok] is builder  # not made again (each one reads the whole vocabulary)


# --- vLLM against HF ---------------------------------------------------------------------------

def coarse_kl(ref_ids: torch.Tensor, ref_lp: torch.Tensor, other_full: torch.Tensor) -> torch.Tensor:
    """Per row, KL(ref || other) over the reference's kept top-k tokens plus one bin for the rest
    of the vocabulary (a lower bound of the full KL that needs only the reference's top-k)."""
    p = ref_lp.exp()                                   # -inf (dropped) -> 0
    q = other_full.gather(-1, ref_ids).exp() * (p > 0)
    kl = (p * (ref_lp - other_full.gather(-1, ref_ids))).nan_to_num(0.0).sum(-1)
    rest_p = (1 - p.sum(-1)).clamp(min=1e-9)
    rest_q = (1 - q.sum(-1)).clamp(min=1e-9)
    return kl + rest_p * (rest_p / rest_q).log()


def overlap(ids_a: torch.Tensor, ids_b: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the share of the top-k ids the two have in common."""
    a, b = ids_a[..., :k], ids_b[..., :k]
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean(-1)


# Bounds for a right alignment: bf16 vLLM against fp32 HF on the tiny peaked model measured
# mean KL 0.0005 (max 0.003 per token), top-5 overlap 0.98, top-1 agreement 0.98 (bf16 logits
# tie); one position off measured KL 6.6, overlap 0.04, and the teacher without its window 7.7.
MAX_MEAN_KL = 0.005
MAX_TOKEN_KL = 0.05
MIN_TOP5_OVERLAP = 0.9
MIN_TOP1_AGREEMENT = 0.95


def compare(model, tok, convs, shift: int = 0):
    batch = collate(convs, teacher=True, pad_id=tok.pad_token_id, device="cpu", questions=True)
    if shift:
        batch = replace(batch, positions=(batch.positions + shift).clamp(min=0, max=batch.input_ids.shape[1] - 1))
    with torch.no_grad():
        hf_lp = answer_logprobs(model, batch)
    m = batch.mask
    hf_top = hf_lp.topk(5, dim=-1).indices
    kl = coarse_kl(batch.topk_ids, batch.topk_logprobs, hf_lp)[m]
    return {"tokens": int(m.sum()), "mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "top5_overlap": float(overlap(batch.topk_ids, hf_top, 5)[m].mean()),
            "top1_agree": float((batch.topk_ids[..., 0] == hf_top[..., 0])[m].float().mean())}


def passes(r) -> bool:
    return (r["mean_kl"] <= MAX_MEAN_KL and r["max_kl"] <= MAX_TOKEN_KL and r["top5_overlap"] >= MIN_TOP5_OVERLAP
            and r["top1_agree"] >= MIN_TOP1_AGREEMENT)


def test_hf_batches_give_the_one_at_a_time_backends_answers_and_targets(hf, doc):
    """The GPU fallback (many conversations per `generate`, left-padded) against HF one at a time
    on the same questions: the same greedy answers, the same answer and question targets, and a
    plain forward of the teacher's sequence agrees with them (one position off it does not)."""
    from lmcache_cartridge.tools.selfstudy.synth import HFBatchBackend, _generate, prompt_targets, teacher_topk

    _, model, tok = hf
    convs = synthesize(HFBatchBackend(model, tok, batch=6), tok, doc.read_text(), SYNTH, count=6, seed=0,
                       tag="t", progress=False)
    assert len(convs) == 6 and len({len(c.teacher_prefix) for c in convs}) > 1  # rows were padded
    for c in convs:
        assert c.topk_ids[:, 0].tolist() == c.answer  # greedy: the answer is the teacher's own top-1
        answer, logits = _generate(model, c.teacher_prefix, max_new_tokens=SYNTH.answer_tokens, temperature=0.0,
                                   seed=0, tokenizer=tok, want_logits=True)
        assert answer == c.answer
        ids, lp = teacher_topk(logits, SYNTH.top_k, SYNTH.cover)
        assert torch.equal(ids[:, :5], c.topk_ids[:, :5])
        torch.testing.assert_close(lp, c.topk_logprobs, rtol=1e-4, atol=1e-4)
        (p_ids, p_lp), _ = prompt_targets(model, c.teacher_prefix,
                                          scored_prompt_tokens(c.teacher_prefix, c.student_prefix), SYNTH)
        assert torch.equal(p_ids[:, :5], c.prompt_topk_ids[:, :5])
        torch.testing.assert_close(p_lp, c.prompt_topk_logprobs, rtol=1e-4, atol=1e-4)
    assert passes(compare(model, tok, convs)) and not passes(compare(model, tok, convs, shift=1))


@pytest.fixture(scope="module")
def vllm_data(hf, doc, tmp_path_factory):
    """Conversations made by `train`'s own path with the vLLM backend (engine started and closed)."""
    pytest.importorskip("vllm")
    model_dir, _, tok = hf
    work = tmp_path_factory.mktemp("vllm-synth")
    cfg = TrainConfig(model_dir=model_dir, text_path=doc, output=work / "c", conversations=12, heldout=4,
                      synth=SYNTH, loop=LoopConfig(steps=3, batch_size=4), device="cpu", progress=False,
                      # the engine as a GPU run starts it (eager), asked in batches that split both streams
                      synth_backend="vllm", synth_batch=5, synth_eager=True)
    train, heldout = load_or_synthesize(cfg, None, tok, doc.read_text())
    return cfg, train, heldout


@pytest.mark.slow
def test_vllm_synthesis_gives_the_data_training_reads(hf, vllm_data):
    cfg, train, heldout = vllm_data
    _, model, tok = hf
    assert len(train) == 12 and len(heldout) == 4
    assert not {c.question for c in heldout} & {c.question for c in train}
    data = torch.load(cfg.work / DATA_NAME, weights_only=True)
    assert data["backend"] == "vllm" and not (cfg.work / SHARDS_NAME).exists()
    for c in train + heldout:
        assert c.teacher_prefix[0] == tok.bos_token_id and c.student_prefix[0] != tok.bos_token_id
        assert c.topk_ids.shape == c.topk_logprobs.shape == (len(c.answer), SYNTH.top_k)
        assert c.topk_ids[:, 0].tolist() == c.answer  # greedy: the answer is vLLM's own top-1
        p = scored_prompt_tokens(c.teacher_prefix, c.student_prefix)
        assert c.prompt_topk_ids.shape == (p, SYNTH.top_k) and torch.isfinite(c.prompt_topk_logprobs[:, 0]).all()
    # The engine is gone, and the same data train on: the loss falls over a few steps.
    from lmcache_cartridge.tools.selfstudy.loop import build_student, run_loop

    student = build_student(model, tok, Path(cfg.text_path).read_text(), 256, 1)
    full = collate(train, teacher=False, pad_id=tok.pad_token_id, device="cpu", questions=True)
    with torch.no_grad():
        before = float(distill_loss(answer_logprobs(student, full), full))
    run_loop(student, train, heldout, replace(cfg.loop, steps=3), work_dir=cfg.work / "loop", fingerprint="fp",
             pad_id=tok.pad_token_id, progress=False)
    with torch.no_grad():
        after = float(distill_loss(answer_logprobs(student, full), full))
    assert after < before


@pytest.mark.slow
def test_vllm_teacher_targets_match_hf_on_the_same_conversations(hf, vllm_data):
    """vLLM's top-k log-probs (answer tokens from `logprobs`, question tokens from
    `prompt_logprobs` with the window served by the prefix cache) against an HF fp32 forward of
    the same token ids: the same top tokens and a small KL; the same comparison one position off
    (or against the model without its window) fails the bounds."""
    _, model, tok = hf
    _, train, heldout = vllm_data
    convs = train + heldout
    right = compare(model, tok, convs)
    off_by_one = compare(model, tok, convs, shift=1)
    off_by_minus_one = compare(model, tok, convs, shift=-1)
    no_window = compare(model, tok, [replace(c, teacher_prefix=c.student_prefix) for c in convs])
    print(f"\n[vllm vs hf] aligned {right}\n  shifted +1 {off_by_one}\n  shifted -1 {off_by_minus_one}"
          f"\n  teacher without its window {no_window}")
    assert right["tokens"] > 100
    assert passes(right), right
    assert not passes(off_by_one) and not passes(off_by_minus_one)
    assert off_by_one["mean_kl"] > 100 * MAX_MEAN_KL and off_by_minus_one["mean_kl"] > 100 * MAX_MEAN_KL
    assert not passes(no_window), no_window


def _kill_engine_core(backend) -> None:
    """SIGKILL the backend's vLLM engine core process (as the kernel's OOM killer would) and wait
    until vLLM's own monitor has seen it die."""
    import os
    import signal
    import time

    core = backend.llm.llm_engine.engine_core
    (proc,) = core.resources.engine_manager.processes
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not core.resources.engine_dead:
        assert time.monotonic() < deadline, "vLLM never noticed its engine core died"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.long  # three engine starts
def test_an_engine_that_dies_is_replaced_once_and_the_batch_comes_out_the_same(hf, doc):
    """A real engine core killed between batches: the next batch starts a new engine and gives
    each plan's conversation again, from the same seeds; killed in both tries, a clear error that
    says how to resume."""
    pytest.importorskip("vllm")
    from lmcache_cartridge.errors import CartridgeError
    from lmcache_cartridge.tools.selfstudy.synth import document_body
    from lmcache_cartridge.tools.selfstudy.vllm_synth import VllmBackend, synth_dtype

    model_dir, _, tok = hf
    body = document_body(tok, doc.read_text())
    specs = [plan(len(body), SYNTH, 0, "train", i, 4) for i in range(4)]
    with VllmBackend(model_dir, tok, SYNTH, batch=4) as backend:
        first = backend.run(body, SYNTH, specs)
        chosen = backend.dtype  # the run's dtype, chosen at the first start, kept by the replacement
        assert chosen == synth_dtype(device_is_cpu=True)
        _kill_engine_core(backend)
        again = backend.run(body, SYNTH, specs)
        assert backend.stats["engine_restarts"] == 1 and backend.llm is not None
        assert backend.dtype == chosen
        assert backend.llm.llm_engine.model_config.dtype == (torch.bfloat16 if chosen == "auto" else torch.float32)
        assert sum(c is not None for c in first) >= 2 and len(again) == len(first)
        for spec, a in zip(specs, again):  # each is its own plan's conversation, with its targets
            assert a is None or (a.window == spec.window and a.topk_ids[:, 0].tolist() == a.answer)
        # The same seeds: the same questions, but where bf16 noise between two engines flips a draw.
        same = sum(a is not None and b is not None and a.question == b.question for a, b in zip(again, first))
        assert 2 * same >= sum(c is not None for c in first), ([c and c.question for c in first],
                                                                [c and c.question for c in again])

        # Killed in the batch and again in the retry: every engine dies as soon as it is asked.
        start = backend.start

        def start_dead():
            llm = start()
            _kill_engine_core(backend)
            return llm

        backend.start = start_dead
        with pytest.raises(CartridgeError, match="stopped twice in the same batch .engine core exit code -9;"
                           ".*rerun the same `train`"):
            backend.run(body, SYNTH, specs)
        assert backend.stats["engine_restarts"] == 2 and backend.llm is None
