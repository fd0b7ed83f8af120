"""The int4 / int4-dynamic batch-1 and batch-8 decode comparison of the README, as it was run (a record, not a
benchmark script): both models in one process, generate() timings interleaved so the machine's drift hits both.

    PYTHONPATH=. python benchmarks/results/int4-dynamic/paired_generate.py BATCH

ms per new token = (time for 49 new tokens - time for 1) / 48 after a 16-token random prompt; median of 6 pairs.
"""

import copy
import sys
import time
from pathlib import Path

import torch

import lightgen


def main(batch: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
    from quantize_quality import load_smollm2

    model, _ = load_smollm2()
    models = {q: lightgen.accelerate_model(copy.deepcopy(model), quantize=q) for q in ("int4", "int4-dynamic")}
    ids = torch.randint(100, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))

    def generate(m, new):
        start = time.perf_counter()
        with torch.no_grad():
            m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    for m in models.values():
        generate(m, 4)
    times = {q: [] for q in models}
    for _ in range(6):
        for q, m in models.items():
            times[q].append((generate(m, 49) - generate(m, 1)) / 48 * 1e3)
    for q, values in times.items():
        values.sort()
        print(q, "ms/token median", round(values[len(values) // 2], 2), [round(v, 2) for v in values])


if __name__ == "__main__":
    main(int(sys.argv[1]))
