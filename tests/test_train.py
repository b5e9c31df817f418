"""Self-study training (`tools/train.py`, `tools/selfstudy/`) on the tiny peaked test model, CPU.

Few steps, small data: the loop's correctness, not the cartridge's quality (that is
`test_train_e2e.py`). References are independent of the code under test where one exists:
PEFT's own model forward for the exported KV layout, HF's KV of the BOS token for the frozen sink.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy.config import (COSINE_FLOOR, LoopConfig, SynthConfig, TrainConfig, check_length,
                                                      default_lr, scheduled_lr)
from lmcache_cartridge.tools.selfstudy.loop import (
    CHECKPOINT_NAME, METRICS_NAME, MetricsLog, accumulate_step, batch_indices, build_student, encoder_of, run_loop,
)
from lmcache_cartridge.tools.selfstudy.objective import answer_logprobs, collate, distill_loss
from lmcache_cartridge.tools.selfstudy.run import (
    DATA_NAME, export_kv, load_for_training, load_or_synthesize, train_cartridge,
)
from lmcache_cartridge.tools.selfstudy.synth import teacher_topk
from lmcache_cartridge.tools.train import main

TOKENS = 256
SYNTH = SynthConfig(window_min=128, window_max=256, question_tokens=16, answer_tokens=16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # 2 shared cores: one thread is several times faster than two here (and deterministic).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> Path:
    from lmcache_cartridge.tools.testmodel import document_text

    p = tmp_path_factory.mktemp("doc") / "doc.txt"
    p.write_text(document_text())
    return p


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return ensure_test_model()


def config(model_dir: Path, doc: Path, out: Path, steps: int, **kw) -> TrainConfig:
    loop = LoopConfig(steps=steps, batch_size=4, lr=2e-2, seed=0, eval_every=kw.pop("eval_every", 100),
                      save_every=kw.pop("save_every", 100))
    return TrainConfig(model_dir=model_dir, text_path=doc, output=out, tokens=TOKENS, conversations=8,
                       heldout=2, synth=SYNTH, loop=loop, device="cpu", progress=False, synth_backend="hf", **kw)


@pytest.fixture(scope="module")
def data_file(model_dir, doc, tmp_path_factory) -> Path:
    """The synthesised conversations, made once and copied into each test's work dir."""
    cfg = config(model_dir, doc, tmp_path_factory.mktemp("data") / "c", steps=1)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, heldout = load_or_synthesize(cfg, model, tok, doc.read_text())
    assert len(train) == 8 and len(heldout) == 2
    assert not {c.question for c in heldout} & {c.question for c in train}
    for c in train + heldout:
        assert c.student_prefix[0] != tok.bos_token_id          # the cartridge owns BOS
        assert c.teacher_prefix[0] == tok.bos_token_id
        assert c.topk_ids.shape == c.topk_logprobs.shape == (len(c.answer), SYNTH.top_k)
        # The teacher's greedy answer token is its own top-1.
        assert c.topk_ids[:, 0].tolist() == c.answer
    return cfg.work / DATA_NAME


def with_data(cfg: TrainConfig, data_file: Path) -> TrainConfig:
    cfg.work.mkdir(parents=True, exist_ok=True)
    shutil.copy(data_file, cfg.work / DATA_NAME)
    return cfg


def test_teacher_topk_keeps_mass_until_cover():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.03, 0.02]]))
    ids, lp = teacher_topk(logits, k=4, cover=0.9)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert torch.isfinite(lp[0]).tolist() == [True, True, False, False]  # 0.6 + 0.3 reaches 0.9
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.6, 0.3]))


def test_teacher_batch_scores_the_answer_where_generate_did(model_dir, doc, data_file):
    """The positions `collate` picks are the answer's: a plain forward of the teacher's sequence
    reproduces the top-k log-probs `generate` recorded for each answer token."""
    cfg = config(model_dir, doc, data_file.parent.parent / "c", steps=1)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, _ = load_or_synthesize(cfg, model, tok, doc.read_text())
    batch = collate(train[:4], teacher=True, pad_id=tok.pad_token_id, device="cpu")
    with torch.no_grad():
        lp = answer_logprobs(model, batch)
    got = lp.gather(-1, batch.topk_ids)
    kept = torch.isfinite(batch.topk_logprobs) & batch.mask.unsqueeze(-1)
    assert kept.sum() > 0
    torch.testing.assert_close(got[kept], batch.topk_logprobs[kept], rtol=1e-3, atol=1e-3)
    # Shifted by one position the teacher's answer is not reproduced (the check can fail).
    shifted = replace(batch, positions=(batch.positions - 1).clamp(min=0))
    with torch.no_grad():
        off = answer_logprobs(model, shifted).gather(-1, batch.topk_ids)
    assert (off[kept] - batch.topk_logprobs[kept]).abs().max() > 1.0


def test_batches_are_a_function_of_seed_and_step():
    seen = [i for s in range(4) for i in batch_indices(s, 8, 4, seed=3)]
    assert sorted(seen[:8]) == list(range(8)) and sorted(seen[8:]) == list(range(8))  # epochs
    assert seen[:8] != seen[8:]                                                       # reshuffled
    assert batch_indices(3, 8, 4, seed=3) == seen[12:]
    assert batch_indices(0, 8, 4, seed=4) != seen[:4]


def test_length_must_fit_serving_chunks(model_dir, doc, tmp_path):
    with pytest.raises(CartridgeError, match=r"not a multiple of the serving chunk size 256.*256 or 512"):
        train_cartridge(replace(config(model_dir, doc, tmp_path / "o", steps=1), tokens=300))
    with pytest.raises(CartridgeError, match="frozen-tokens"):
        check_length(256, 256, 256)
    for lo, hi in ((512, 256), (0, 256)):  # an empty draw, a zero-length window: refused, not crashed
        bad = replace(config(model_dir, doc, tmp_path / "o", steps=1),
                      synth=replace(SYNTH, window_min=lo, window_max=hi))
        with pytest.raises(CartridgeError, match=f"--window-min {lo} and --window-max {hi}: give a positive"):
            train_cartridge(bad)
    assert not (tmp_path / "o.train").exists()  # refused before any work
    # Same rule as pack_kv's (the writer refuses such a trained cartridge too).
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.errors import CartridgeFormatError

    with pytest.raises(CartridgeFormatError, match="not a multiple of chunk_size 256"):
        pack_kv(torch.zeros(2, 1, 300, 1, 2), tmp_path / "p", cartridge_id="x", model="m", kind="trained",
                vocab=VocabInfo(1024, (0, 1, 2, 3)))


def test_few_steps_lower_the_loss_keep_the_sink_and_pack(model_dir, doc, data_file, tmp_path):
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    cfg = with_data(config(model_dir, doc, tmp_path / "cart", steps=6, kv_dtype="float32",
                           eval_every=6), data_file)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, heldout = load_or_synthesize(cfg, model, tok, doc.read_text())
    student = build_student(model, tok, doc.read_text(), TOKENS, 1)
    init = encoder_of(student).weight.detach().clone()
    full = collate(train, teacher=False, pad_id=tok.pad_token_id, device="cpu")
    with torch.no_grad():
        loss_before = float(distill_loss(answer_logprobs(student, full), full))

    res = run_loop(student, train, heldout, cfg.loop, work_dir=tmp_path / "loop", fingerprint="fp",
                   pad_id=tok.pad_token_id, progress=False)
    after = encoder_of(student).weight.detach()
    with torch.no_grad():
        loss_after = float(distill_loss(answer_logprobs(student, full), full))
    print(f"\n[train] objective on the training set {loss_before:.4f} -> {loss_after:.4f}; "
          f"step losses {[round(x, 3) for x in res.losses]}; held-out KL {res.heldout_kl}")
    assert len(res.losses) == 6
    assert loss_after < loss_before
    # Only the KV moves; the sink token is bit-identical, and it is the BOS's own KV at position 0.
    assert torch.equal(after[0], init[0])
    assert not torch.equal(after[1:], init[1:])
    assert all(not p.requires_grad for p in student.get_base_model().parameters())
    bos_kv = compute_prefix_kv(model, [tok.bos_token_id])  # [2, L, 1, H, D]
    kv = export_kv(student)
    assert kv.shape == (2, model.config.num_hidden_layers, TOKENS, model.config.num_key_value_heads,
                        model.config.hidden_size // model.config.num_attention_heads)
    torch.testing.assert_close(kv[:, :, :1], bos_kv.float())
    assert set(res.heldout_kl) == {0, 6}

    # The whole command on the same data: a packed trained cartridge with provenance + adapter.
    res2 = train_cartridge(replace(cfg, adapter_dir=tmp_path / "adapter"))
    m = res2.manifest
    assert (m.kind, m.num_tokens, m.chunk_size, m.dtype) == ("trained", TOKENS, 256, "float32")
    p = m.provenance
    assert p["steps"] == 6 and p["method"] == "self_study" and p["init"] == "first_k"
    assert p["data"]["conversations"] == 8 and p["data"]["heldout_conversations"] == 2
    assert p["loss"]["last"] == pytest.approx(res.losses[-1], rel=1e-4)
    assert p["heldout_kl"]["init"] == pytest.approx(res.heldout_kl[0], rel=1e-4)
    packed = PackedCartridge(cfg.output)
    assert packed.verify().ok
    torch.testing.assert_close(packed.load_kv(), kv, rtol=1e-4, atol=1e-4)
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "CARTRIDGE" and adapter["num_virtual_tokens"] == TOKENS
    assert adapter["num_frozen_tokens"] == 1


def test_packed_kv_is_what_peft_computes_with(model_dir, doc, data_file, tmp_path):
    """Oracle: PEFT's own forward with the adapter vs HF given the exported KV as past_key_values."""
    from peft import PeftModel
    from lmcache_cartridge.cartridge.model_kv import kv_to_cache
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    cfg = with_data(config(model_dir, doc, tmp_path / "cart", steps=2, kv_dtype="float32",
                           adapter_dir=tmp_path / "adapter"), data_file)
    train_cartridge(cfg)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    kv = PackedCartridge(cfg.output).load_kv()
    conv = load_or_synthesize(cfg, model, tok, doc.read_text())[1][0]
    ids = torch.tensor([conv.student_prefix + conv.answer])
    with torch.no_grad():
        ours = model(input_ids=ids, past_key_values=kv_to_cache(kv, model.config), use_cache=True).logits
        peft_model = PeftModel.from_pretrained(model, str(tmp_path / "adapter"))
        theirs = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        wrong = model(input_ids=ids, past_key_values=kv_to_cache(kv[:, :, :, [1, 0]].contiguous(), model.config),
                      use_cache=True).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (wrong - theirs).abs().max() > 1.0  # a head swap is visible on the peaked model


def test_resume_continues_exactly(model_dir, doc, data_file, tmp_path):
    straight = with_data(config(model_dir, doc, tmp_path / "a", steps=4, kv_dtype="float32", save_every=2),
                         data_file)
    first = train_cartridge(straight)
    half = with_data(config(model_dir, doc, tmp_path / "b", steps=2, kv_dtype="float32", save_every=2), data_file)
    train_cartridge(half)
    ck = torch.load(half.work / CHECKPOINT_NAME, weights_only=True)
    assert ck["step"] == 2
    resumed = train_cartridge(replace(half, loop=replace(half.loop, steps=4), overwrite=True))
    assert resumed.loop.resumed_from == 2 and len(resumed.loop.losses) == 2
    assert resumed.loop.losses == first.loop.losses[2:]
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    assert torch.equal(PackedCartridge(straight.output).load_kv(), PackedCartridge(half.output).load_kv())
    steps = [r["step"] for r in map(json.loads, (half.work / METRICS_NAME).read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]

    # A work dir of a run with other settings is refused, not silently mixed.
    other = replace(half, loop=replace(half.loop, steps=4, lr=1e-3), overwrite=True)
    with pytest.raises(CartridgeError, match="other settings"):
        train_cartridge(other)


def test_micro_batches_make_the_step_of_one_whole_batch(model_dir, doc, data_file, tmp_path):
    """`--micro-batch`: a step of 8 conversations run 3 at a time has the gradient and loss of one
    forward pass over all 8 (each part weighted by its share of the scored tokens, which differ
    per conversation), no forward pass sees more than 3, and a run may resume with another value."""
    cfg = with_data(config(model_dir, doc, tmp_path / "ref", steps=1), data_file)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, _ = load_or_synthesize(cfg, model, tok, doc.read_text())
    student = build_student(model, tok, doc.read_text(), TOKENS, 1)
    kv = encoder_of(student).trainable_embedding

    whole = collate(train, teacher=False, pad_id=tok.pad_token_id, device="cpu", questions=True)
    assert len(set(whole.mask.sum(1).tolist())) > 1  # unequal parts: a plain mean of part means would differ
    loss = distill_loss(answer_logprobs(student, whole), whole)
    loss.backward()
    reference, kv.grad = kv.grad.clone(), None

    rows = []
    hook = student.get_base_model().register_forward_pre_hook(
        lambda _m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        value = accumulate_step(student, train, micro_batch=3, pad_id=tok.pad_token_id, questions=True)
    finally:
        hook.remove()
    assert rows == [3, 3, 2]
    assert value == pytest.approx(float(loss.detach()), rel=1e-6)
    # float32 sums in another order: equal to a millionth of the gradient's largest entry
    torch.testing.assert_close(kv.grad, reference, rtol=1e-5, atol=1e-6 * float(reference.abs().max()))

    def run(out, micro, steps):
        c = config(model_dir, doc, tmp_path / out, steps=steps, kv_dtype="float32", save_every=1)
        return with_data(replace(c, loop=replace(c.loop, batch_size=8, micro_batch=micro)), data_file)

    from lmcache_cartridge.cartridge.packed import PackedCartridge

    whole_cfg = run("one", 8, 2)
    one = train_cartridge(whole_cfg)
    parts = run("parts", 3, 1)
    train_cartridge(parts)
    resumed = train_cartridge(replace(parts, loop=replace(parts.loop, micro_batch=5, steps=2), overwrite=True))
    assert resumed.loop.resumed_from == 1
    assert resumed.loop.losses == pytest.approx(one.loop.losses[1:], rel=1e-5)
    # Adam moves an entry whose gradient is rounding noise by up to the rate either way, so the
    # two runs agree to a small fraction of how far the KV moved, not bit for bit.
    start = export_kv(student).float()
    a, b = PackedCartridge(parts.output).load_kv(), PackedCartridge(whole_cfg.output).load_kv()
    assert float((a - b).norm()) < 1e-3 * float((b - start).norm())


def test_a_run_stopped_before_its_first_checkpoint_logs_each_step_once(model_dir, doc, data_file, tmp_path):
    cfg = with_data(config(model_dir, doc, tmp_path / "c", steps=2, eval_every=1), data_file)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, heldout = load_or_synthesize(cfg, model, tok, doc.read_text())
    student = build_student(model, tok, doc.read_text(), TOKENS, 1)
    work = tmp_path / "loop"
    run_loop(student, train, heldout, cfg.loop, work_dir=work, fingerprint="fp", pad_id=tok.pad_token_id,
             progress=False)
    (work / CHECKPOINT_NAME).unlink()  # as if stopped before it was written
    student = build_student(model, tok, doc.read_text(), TOKENS, 1)
    again = run_loop(student, train, heldout, cfg.loop, work_dir=work, fingerprint="fp", pad_id=tok.pad_token_id,
                     progress=False)
    assert again.resumed_from == 0
    records = [(r["step"], "loss" if "loss" in r else "kl") for r in MetricsLog.read(work / METRICS_NAME)]
    assert records == [(0, "kl"), (1, "loss"), (1, "kl"), (2, "loss"), (2, "kl")]


def test_cosine_schedule_decays_to_its_floor_and_resumes_on_the_same_curve(model_dir, doc, data_file, tmp_path,
                                                                          monkeypatch):
    assert scheduled_lr(1.0, "cosine", 0, 5) == 1.0
    assert scheduled_lr(1.0, "cosine", 4, 5) == pytest.approx(COSINE_FLOOR)
    rates = [scheduled_lr(1.0, "cosine", s, 5) for s in range(5)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 5
    assert {scheduled_lr(1.0, "constant", s, 5) for s in range(5)} == {1.0}

    def cosine(out, steps):
        cfg = config(model_dir, doc, tmp_path / out, steps=steps, kv_dtype="float32", save_every=2)
        return with_data(replace(cfg, loop=replace(cfg.loop, lr_schedule="cosine")), data_file)

    straight = cosine("a", 4)
    first = train_cartridge(straight)
    constant = train_cartridge(with_data(config(model_dir, doc, tmp_path / "c", steps=4, kv_dtype="float32"),
                                         data_file))
    assert first.loop.losses[0] == constant.loop.losses[0]   # the same first rate
    assert first.loop.losses[2:] != constant.loop.losses[2:]  # then a lower one
    # Stopped after step 2's checkpoint (as by Ctrl-C) and rerun: the rest of the same curve.
    from lmcache_cartridge.tools.selfstudy import loop as loop_mod

    half, real_save = cosine("b", 4), loop_mod.save_checkpoint

    def save_then_stop(work_dir, **kw):
        real_save(work_dir, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_cartridge(half)
    monkeypatch.setattr(loop_mod, "save_checkpoint", real_save)
    resumed = train_cartridge(half)
    assert resumed.loop.resumed_from == 2 and resumed.loop.losses == first.loop.losses[2:]
    # A cosine run's length is part of it: another --steps is another run, refused.
    with pytest.raises(CartridgeError, match="other settings"):
        train_cartridge(replace(half, loop=replace(half.loop, steps=6), overwrite=True))
    assert json.loads((straight.output / "manifest.json").read_text())["provenance"]["optimizer"]["lr_schedule"] \
        == "cosine"


def test_bf16_autocast_trains_close_to_fp32_and_is_its_own_run(model_dir, doc, data_file, tmp_path):
    """`--autocast bfloat16`: the steps run in bf16 (the losses are not fp32's bit for bit) and
    stay close to fp32's; a checkpoint of one is not resumed as the other; provenance says which."""
    def run(out, autocast):
        cfg = config(model_dir, doc, tmp_path / out, steps=3, kv_dtype="float32", save_every=1)
        return with_data(replace(cfg, loop=replace(cfg.loop, autocast=autocast)), data_file)

    fp32 = train_cartridge(run("fp32", None))
    bf16_cfg = run("bf16", "bfloat16")
    bf16 = train_cartridge(bf16_cfg)
    print("fp32", fp32.loop.losses, "bf16 autocast", bf16.loop.losses)
    assert bf16.loop.losses != fp32.loop.losses
    assert bf16.loop.losses == pytest.approx(fp32.loop.losses, rel=0.01)
    prov = json.loads((bf16_cfg.output / "manifest.json").read_text())["provenance"]
    assert prov["autocast"] == "bfloat16" and prov["train_dtype"] == "float32"
    # The bf16 run's checkpoint under the fp32 settings: another run, refused.
    with pytest.raises(CartridgeError, match="other settings"):
        train_cartridge(replace(bf16_cfg, loop=replace(bf16_cfg.loop, autocast=None, steps=4), overwrite=True))


def test_anchor_pulls_the_kv_toward_its_first_k_start_and_resumes_on_the_same_path(model_dir, doc, data_file,
                                                                                    tmp_path):
    """`--anchor A`: after each Adam step the KV moves lr*A of the way back to its first-k start.
    All the way back (lr*A = 1) leaves the start itself; half way keeps it nearer than no anchor;
    a resumed run pulls toward the same start (not toward its checkpoint); it is its own run."""
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    def run(out, anchor, steps=4, **kw):
        cfg = config(model_dir, doc, tmp_path / out, steps=steps, kv_dtype="float32", save_every=2, **kw)
        return with_data(replace(cfg, loop=replace(cfg.loop, anchor=anchor)), data_file)

    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    start = export_kv(build_student(model, tok, doc.read_text(), TOKENS, 1))
    moved = {}
    for name, anchor in (("free", 0.0), ("half", 25.0), ("all", 50.0)):  # lr 2e-2: shares 0, 0.5, 1
        cfg = run(name, anchor)
        train_cartridge(cfg)
        moved[name] = float((PackedCartridge(cfg.output).load_kv() - start).norm())
    print("distance from the first-k start after 4 steps:", moved)
    assert moved["all"] == 0.0
    assert 0.0 < moved["half"] < moved["free"]
    half = json.loads((tmp_path / "half" / "manifest.json").read_text())["provenance"]["optimizer"]
    assert half["anchor"] == 25.0

    stopped = run("stopped", 25.0, steps=2)
    train_cartridge(stopped)
    train_cartridge(replace(stopped, loop=replace(stopped.loop, steps=4), overwrite=True))
    assert torch.equal(PackedCartridge(stopped.output).load_kv(), PackedCartridge(tmp_path / "half").load_kv())
    with pytest.raises(CartridgeError, match="other settings"):  # an anchored checkpoint is not a free run's
        train_cartridge(replace(stopped, loop=replace(stopped.loop, anchor=0.0, steps=5), overwrite=True))
    with pytest.raises(CartridgeError, match="--anchor must be 0"):
        train_cartridge(run("negative", -1.0))
    with pytest.raises(CartridgeError, match=r"give an anchor in \[0, 50\]"):
        train_cartridge(run("past", 100.0))


def test_trim_repeats_cuts_a_looping_answer_before_its_first_repeat():
    from lmcache_cartridge.tools.selfstudy.synth import Conversation, trim_repeats

    answer = [7, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    ids = torch.arange(len(answer) * 2).reshape(len(answer), 2)
    conv = Conversation("question", (0, 8), "q?", [1], [1, 2], answer, ids, ids.float())
    cut = trim_repeats(conv, 3)
    assert cut.answer == [7, 1, 2, 3, 4]                  # (1, 2, 3) came back at index 5
    assert torch.equal(cut.topk_ids, ids[:5]) and torch.equal(cut.topk_logprobs, ids[:5].float())
    assert trim_repeats(conv, 0) is conv and trim_repeats(conv, 6).answer == answer[:5]
    assert trim_repeats(conv, 7) is conv                   # no run of 7 tokens comes back
    assert conv.answer == answer                           # the data itself is not changed


def test_trim_repeats_trains_on_the_cut_answers_and_is_its_own_run(model_dir, doc, data_file, tmp_path):
    from lmcache_cartridge.tools.selfstudy.synth import Conversation, trim_repeats

    data = torch.load(data_file, weights_only=True)["train"]
    convs = [Conversation.from_dict(d) for d in data]
    whole = sum(len(c.answer) for c in convs)
    kept = sum(len(trim_repeats(c, 2).answer) for c in convs)
    assert kept < whole  # the tiny model's 16-token answers repeat themselves
    cfg = config(model_dir, doc, tmp_path / "trim", steps=2, kv_dtype="float32", save_every=1)
    cfg = with_data(replace(cfg, loop=replace(cfg.loop, trim_repeats=2)), data_file)
    out = train_cartridge(cfg)
    plain = train_cartridge(with_data(config(model_dir, doc, tmp_path / "plain", steps=2, kv_dtype="float32"),
                                      data_file))
    assert out.loop.losses != plain.loop.losses
    prov = json.loads((cfg.output / "manifest.json").read_text())["provenance"]["data"]
    assert (prov["answer_tokens"], prov["answer_tokens_trained"], prov["trim_repeats"]) == (whole, kept, 2)
    with pytest.raises(CartridgeError, match="other settings"):  # its checkpoint is not a whole-answer run's
        train_cartridge(replace(cfg, loop=replace(cfg.loop, trim_repeats=0, steps=3), overwrite=True))
    with pytest.raises(CartridgeError, match="trim-repeats"):
        train_cartridge(replace(cfg, loop=replace(cfg.loop, trim_repeats=-1), overwrite=True))


def test_seed_types_draw_training_conversations_from_those_types_only(model_dir, doc, data_file, tmp_path, capsys):
    """`--seed-types question`: every training conversation from a question seed prompt, the
    held-out ones the same as a run with all five (their KL compares), other data than the
    default's; the default keeps the fingerprint of data drawn before the option existed."""
    import hashlib
    from dataclasses import asdict

    from lmcache_cartridge.tools.selfstudy.config import SEED_TYPES, _digest, parse_seed_types

    default = config(model_dir, doc, tmp_path / "all", steps=1)
    only = replace(default, output=tmp_path / "q", synth=replace(SYNTH, seed_types=("question",)))
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, heldout = load_or_synthesize(only, model, tok, doc.read_text())
    assert [c.seed_type for c in train] == ["question"] * 8
    reference = torch.load(data_file, weights_only=True)
    assert len({d["seed_type"] for d in reference["train"]}) > 1  # the default mix draws several types
    assert [c.question for c in heldout] == [d["question"] for d in reference["heldout"]]
    text = doc.read_text()
    assert only.data_fingerprint(text) != default.data_fingerprint(text)
    synth = asdict(default.synth)
    del synth["seed_types"], synth["placement"]
    assert default.data_fingerprint(text) == _digest({
        "model_dir": str(model_dir.resolve()), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "conversations": 8, "heldout": 2, "synth": synth, "seed": 0})
    assert reference["fingerprint"] == default.data_fingerprint(text)
    assert parse_seed_types("question, structuring") == ("structuring", "question")  # one order: one draw
    assert parse_seed_types(",".join(SEED_TYPES)) == SEED_TYPES
    argv = ["--model-dir", str(model_dir), "--text", str(doc), "-o", str(tmp_path / "cli"), "--device", "cpu", "-q"]
    assert main([*argv, "--seed-types", "question,quiz"]) == 2
    assert "'quiz' is not one" in capsys.readouterr().err
    assert main([*argv, "--seed-types", ""]) == 2
    assert "give one or more of structuring,summarization" in capsys.readouterr().err


def test_window_placement_tile_draws_other_training_windows_and_the_same_heldout(model_dir, doc, data_file,
                                                                                   tmp_path):
    """`--window-placement tile`: the training windows tile the document (other data, another
    fingerprint); the held-out conversations are the default run's, so their KL compares."""
    from lmcache_cartridge.tools.train import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(["--model-dir", str(model_dir), "--text", str(doc), "-o", str(tmp_path / "t"),
                         "--window-placement", "tile", "--window-min", "128", "--window-max", "256"])
    assert config_from_args(args).synth.placement == "tile"
    default = config(model_dir, doc, tmp_path / "even", steps=1)
    tiled = replace(default, output=tmp_path / "tile", synth=replace(SYNTH, placement="tile"))
    text = doc.read_text()
    assert tiled.data_fingerprint(text) != default.data_fingerprint(text)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    train, heldout = load_or_synthesize(tiled, model, tok, text)
    reference = torch.load(data_file, weights_only=True)
    assert [c.window for c in train] != [tuple(d["window"]) for d in reference["train"]]
    assert [c.question for c in heldout] == [d["question"] for d in reference["heldout"]]


def test_cli_trains_and_reports(model_dir, doc, data_file, tmp_path, capsys):
    out = tmp_path / "cli-cart"
    work = tmp_path / "cli-work"
    work.mkdir()
    shutil.copy(data_file, work / DATA_NAME)
    argv = ["--model-dir", str(model_dir), "--text", str(doc), "-o", str(out), "--work-dir", str(work),
            "--conversations", "8", "--heldout", "2", "--steps", "2", "--batch-size", "4",
            "--window-min", "128", "--window-max", "256", "--question-tokens", "16", "--answer-tokens", "16",
            "--device", "cpu", "--id", "cli-trained", "-q"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "trained cli-trained: 256 tokens, 2 steps, held-out KL" in said
    # No --lr: the rate measured for small models, not the paper's for 1B-8B (which erased facts).
    prov = json.loads((out / "manifest.json").read_text())["provenance"]
    assert prov["optimizer"]["lr"] == default_lr(1_000_000) == 2e-3
    assert default_lr(8_000_000_000) == 2e-2
    # The data were reused (same fingerprint), not synthesised again: still the copied file.
    assert (work / DATA_NAME).read_bytes() == data_file.read_bytes()
    assert main(argv) == 2  # the output exists: one-line error, no traceback
    assert "already exists" in capsys.readouterr().err


def test_synthesis_options_reach_the_vllm_engine_and_a_zero_batch_is_refused(model_dir, doc, tmp_path, capsys):
    """`--synth-batch` and `--synth-eager` are the engine's (its start is left to first use);
    they decide how the conversations are made, not which: no fingerprint holds them."""
    import argparse

    from lmcache_cartridge.tools.selfstudy.run import vllm_backend
    from lmcache_cartridge.tools.train import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    base = ["--model-dir", str(model_dir), "--text", str(doc), "-o", str(tmp_path / "o")]
    cfg = config_from_args(p.parse_args(base + ["--synth-batch", "1024", "--synth-eager"]))
    backend = vllm_backend(cfg, None)
    assert (backend.batch, backend.enforce_eager, backend.llm) == (1024, True, None)
    default = config_from_args(p.parse_args(base))
    assert (vllm_backend(default, None).batch, vllm_backend(default, None).enforce_eager) == (128, False)
    assert vllm_backend(default, None).dtype is None  # chosen at the engine's start (`synth_dtype`)
    bf16 = config_from_args(p.parse_args(base + ["--synth-dtype", "bfloat16"]))
    assert vllm_backend(bf16, None).dtype == "bfloat16"
    text = doc.read_text()
    assert bf16.data_fingerprint(text) == default.data_fingerprint(text)  # the same conversations, up to rounding
    assert cfg.data_fingerprint(text) == default.data_fingerprint(text)
    assert cfg.fingerprint(text) == default.fingerprint(text)
    assert main(base + ["--synth-batch", "0", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--synth-batch must be positive" in err and "Traceback" not in err
    assert main(base + ["--micro-batch", "0", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch and --steps must be positive" in err and "Traceback" not in err
    assert not (tmp_path / "o.train").exists()  # refused before any work


def test_synthesis_runs_in_fp32_on_a_cpu_without_native_bf16():
    """vLLM's default dtype for synthesis: the checkpoint's, except on a CPU whose flags (as the
    kernel reports them) have neither AVX-512 BF16 nor AMX, where bf16 matmuls are emulated."""
    from lmcache_cartridge.tools.selfstudy.vllm_synth import native_bf16, synth_dtype

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert native_bf16() == native
    assert synth_dtype(device_is_cpu=True) == ("auto" if native else "float32")
    assert synth_dtype(device_is_cpu=False) == "auto"  # a GPU computes in the checkpoint's dtype

@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_student_is_trained_on_the_prompt_the_gateway_serves_after_a_trained_cartridge(family, doc):
    """The student's prompt after its cartridge is the gateway's chat prompt after a trained
    cartridge, token for token: the user turn right after the sink, no BOS and no default system
    block (the tiny Qwen2's ChatML template, like Qwen2-Instruct's, inserts one by default)."""
    from lmcache_cartridge.api.prompts import PromptBuilder
    from lmcache_cartridge.tools.selfstudy.synth import synthesize
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model(family=family)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    (conv,) = synthesize(model, tok, doc.read_text(), SYNTH, count=1, seed=0, tag="t", progress=False)
    sink = [5]  # any cartridge prefix: the gateway puts the trained cartridge's ids first
    served = PromptBuilder(str(model_dir)).chat_ids([{"role": "user", "content": conv.question}], sink,
                                                   after_trained=True)
    assert served == sink + conv.student_prefix
    text = tok.decode(conv.student_prefix)
    assert "system" not in text and "helpful assistant" not in text, text
    assert conv.student_prefix[0] != tok.bos_token_id


def test_cli_without_peft_says_what_to_install(model_dir, doc, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ModuleNotFoundError
    rc = main(["--model-dir", str(model_dir), "--text", str(doc), "-o", str(tmp_path / "c"), "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "lmcache-cartridge[train]" in err and "Traceback" not in err, err
