"""A text encoder kept whole on rank 0 against split by layers over 2 ranks (``parallel.text_encoder: rank0`` and
``split``, ``xfuse.parallel.text_encoder_split``), on this CPU: the encode's wall time, each rank's resident memory,
the bytes the split sends, and that the outputs are equal.

    python benchmarks/bench_text_encoder.py [--layers 12] [--tokens 512] [--repeats 5] [--out DIR]

The encoder: a ``Qwen3ForCausalLM`` (FLUX.2 [klein]'s and Z-Image's architecture) with Qwen3's 151936-token vocabulary
and head layout (1024 wide, 16 query heads and 8 K/V heads of 64, MLP 3072, tied embeddings), ``--layers`` deep,
random weights (seed 0), float32. One call as the FLUX.2 pipelines make it: a batch of one ``--tokens``-token prompt
(random ids), every hidden state returned.

The variants, each in a fresh world (one torch thread per rank, each rank pinned to its own core, gloo on loopback),
in turns (a round runs ``rank0`` then ``split 2``, so the machine's drift falls on both alike):

* ``rank0``: one process builds the encoder and calls it.
* ``split 2``: both ranks build it and keep their share (rank 0 its first half of the layers, the embeddings and the
  final norm; rank 1 its half and the norm); rank 0 calls it inside the group's lead, rank 1 serves.

Each world encodes once to warm up, then ``--repeats`` times; the median and min–max of rank 0's wall clock per call
are reported. Memory per rank: the resident size after the encoder is built and sharded (``VmRSS``: the libraries and
the weights it keeps) and the peak during the timed calls (``VmHWM`` after ``clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import pin_to_core  # noqa: E402
from benchmarks.bench_vae import QUIET, _reset_peak, _status_mib  # noqa: E402

VARIANTS = {"rank0": 1, "split 2": 2}


def build_encoder(layers: int):
    """The benchmark's Qwen3 (module docstring), seeded."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def encode_rank(layers: int, tokens: int, repeats: int) -> dict:
    """On every rank of a fresh world: build (and, over 2 ranks, split) the encoder, warm up, time ``repeats``
    calls. Rank 0 returns the times, every rank its memory (and the bytes it sent)."""
    import gc

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    pin_to_core(rank, world)
    torch.set_num_threads(1)
    encoder = build_encoder(layers)
    ids = torch.randint(0, 151936, (1, tokens), generator=torch.Generator().manual_seed(1))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    text = context = None
    if world > 1:
        from xfuse.config import config_from_dict
        from xfuse.parallel.text_encoder_split import SplitTextEncoder, TextGroup
        from xfuse.runtime.world import init_parallel

        context = init_parallel(config_from_dict({"model": "flux2-klein-tiny",
                                                  "parallel": {"pipefusion_degree": world}}))  # fmt: skip
        ranks = list(range(world))
        group = dist.new_group(ranks=ranks, backend="gloo")
        split = SplitTextEncoder(encoder, name="text_encoder", index=rank, ranks=ranks, channels=context.channels,
                                 group=group, device=torch.device("cpu"))  # fmt: skip
        text = TextGroup({"text_encoder": split}, group)
    gc.collect()
    held = _status_mib("VmRSS")
    params = sum(p.numel() for p in encoder.parameters())

    def encode():
        if text is None:
            return encoder(**call)
        if rank != 0:
            return text.serve()
        with text.leading():
            return encoder(**call)

    seconds, output = [], None
    with torch.no_grad():
        encode()  # warm-up
        if world > 1:
            dist.barrier()
            context.channels.counters.reset()
        reset = _reset_peak()
        for _ in range(repeats):
            start = time.perf_counter()
            output = encode()
            seconds.append(time.perf_counter() - start)
    row = dict(params=params, rss_held_mib=held, peak_rss_mib=_status_mib("VmHWM") if reset else None)
    if context is not None:
        row["sent_bytes_per_call"] = {k: v // repeats for k, v in context.channels.counters.sent_bytes.items()}
    if rank == 0:
        row["seconds"] = seconds
        row["checksum"] = [float(h.double().abs().sum()) for h in output.hidden_states]
    return row


def run_variant(variant: str, layers: int, tokens: int, repeats: int) -> list[dict]:
    from tests.support.world import World

    with World(VARIANTS[variant], threads_per_rank=1, env=QUIET, start_timeout=600) as world:
        return world.run_ok(encode_rank, layers, tokens, repeats, timeout=1800)


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="worlds per variant, taken in turns")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    rows: dict = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            rows[variant].append(run_variant(variant, args.layers, args.tokens, args.repeats))
    report: dict = {"layers": args.layers, "tokens": args.tokens, "repeats": args.repeats, "rounds": args.rounds,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}  # fmt: skip
    for variant, worlds in rows.items():
        ranks = len(worlds[0])
        report["variants"][variant] = {
            "seconds": spread([s for world in worlds for s in world[0]["seconds"]]),
            "params": [worlds[0][r]["params"] for r in range(ranks)],
            "rss_held_mib": [max(world[r]["rss_held_mib"] for world in worlds) for r in range(ranks)],
            "peak_rss_mib": [max(world[r]["peak_rss_mib"] or 0 for world in worlds) for r in range(ranks)],
            "sent_bytes_per_call": [worlds[0][r].get("sent_bytes_per_call") for r in range(ranks)],
        }
    whole, split = (rows[v][0][0]["checksum"] for v in VARIANTS)
    report["outputs_equal"] = whole == split
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "text_encoder.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    for variant, row in report["variants"].items():
        s = row["seconds"]
        print(f"{variant:<8} {s['median']:.3f} s ({s['min']:.3f}-{s['max']:.3f}); parameters per rank "
              f"{row['params']}; resident per rank {[round(m) for m in row['rss_held_mib']]} MiB, peak "
              f"{[round(m) for m in row['peak_rss_mib']]} MiB; sent {row['sent_bytes_per_call']}")  # fmt: skip
    print(f"outputs equal: {report['outputs_equal']}")


if __name__ == "__main__":
    main()
