"""Hand-off time to first token: the target re-prefilling the text vs translating the source's
cache and running one decoding step, in one process, interleaved, median of `runs`.

The source already holds its cache (it has just served the conversation), so its prefill is not
timed; text is tokenized once outside both arms. The hand-off arm times alignment, translation
(head rows native, and the last `native_tail` rows, which the target prefills over the translated
ones) and the target's step on its last token. FLOPs: the translator's multiply-
accumulates per token next to the target's own per-token prefill MACs, and the MAC ceiling
(re-prefill MACs / (translation + head and tail rows + one step)).
"""

from __future__ import annotations

import torch

from kvforge.flops import decode_macs, exact_macs
from kvforge.bench.harness import environment, interleaved_metric_medians, timed
from kvforge.data.prompts import plain_texts
from kvforge.translate.align import align, tokenize
from kvforge.translate.capture import own_tokens
from kvforge.translate.handoff import native_rows, translate_cache
from kvforge.translate.translator import Translator


def text_of_tokens(tokenizer, tokens: int) -> str:
    """Held-out plain text that `tokenizer` makes into exactly `tokens` tokens (BoS included)."""
    pieces, text = plain_texts("held_out", 400, min_chars=200, max_chars=20000), ""
    for piece in pieces:
        text = f"{text}\n\n{piece}" if text else piece
        t = tokenize(tokenizer, text)
        if len(t.ids) >= tokens:
            end = int(t.spans[tokens - 1, 1])
            return text[:end]
    raise ValueError(f"held-out data holds fewer than {tokens} tokens")


def bench_lingo(translator: Translator, source, target, lengths: list[int], runs: int = 3, progress=None, native_tail: int = 0) -> dict:
    results = []
    for n in lengths:
        text = text_of_tokens(target.model.tokenizer, n)
        src, tgt = tokenize(source.model.tokenizer, text), tokenize(target.model.tokenizer, text)
        _, src_cache = source.prefill([src.ids], logits="none")
        if progress:
            progress(f"{n} target tokens ({len(src.ids)} source tokens)")

        def reprefill():
            seconds, _ = timed(lambda: target.prefill([tgt.ids]))
            return {"s": seconds}

        def handoff():
            def run():
                alignment = align(src, tgt, translator.align).truncate(len(tgt.ids) - 1)
                cache = translate_cache(translator, source, target, src_cache, alignment, tgt.ids, native_tail)
                return cache

            translate_s, cache = timed(run)
            step_s, _ = timed(lambda: target.decode_step(torch.tensor([tgt.ids[-1]]), cache))
            return {"s": translate_s + step_s, "translate_s": translate_s, "step_s": step_s}

        medians = interleaved_metric_medians({"reprefill": reprefill, "handoff": handoff}, runs)
        rows = len(tgt.ids) - 1  # the cache's; the last token is the step
        head, native_from = native_rows(align(src, tgt, translator.align).truncate(rows), native_tail)
        translated_rows = native_from - head
        a = target.adapter
        own = own_tokens(target, tgt.ids, head, translated_rows, translator.own_tokens)
        translate_macs = translator.macs(translated_rows, 0 if own is None else own.embeddings.shape[0])
        tail_macs = exact_macs(a, rows) - exact_macs(a, native_from)  # the tail's rows, attending to every row before them
        handoff_macs = translate_macs + exact_macs(a, head) + tail_macs + decode_macs(a, [rows] * a.num_layers)
        results.append(
            {
                "tokens": len(tgt.ids),
                "source_tokens": len(src.ids),
                "method": "handoff",
                "native_tail": native_tail,
                "reprefill_s": medians["reprefill"]["s"],
                "handoff_s": medians["handoff"]["s"],
                "translate_s": medians["handoff"]["translate_s"],
                "step_s": medians["handoff"]["step_s"],
                "speedup": medians["reprefill"]["s"] / medians["handoff"]["s"],
                "ceiling": exact_macs(a, len(tgt.ids)) / handoff_macs,
                "translator_macs_per_token": translator.macs_per_token(),  # every own-token term per row
                "translator_macs_per_translated_row": translate_macs / max(translated_rows, 1),  # own-token terms per distinct token
                "target_macs_per_token": exact_macs(a, len(tgt.ids)) / len(tgt.ids),
            }
        )
    return {
        "command": "bench lingo",
        "model": target.model.name,
        "source": source.model.name,
        "target": target.model.name,
        "method": "handoff",
        "tokens": [r["tokens"] for r in results],
        "runs": runs,
        **environment(target),
        "results": results,
    }
