"""Runs a GGUF model with llama.cpp (llama-cpp-python's C API) for benchmarks/vs_llama_cpp.py, in a process of its own.

Why a process: llama.cpp's CPU backend runs its own thread pool (OpenMP in the wheel's default build); in a
process that loaded torch, two thread teams share 2 cores and slow each other (benchmarks/_ct2_worker.py
measured it for CTranslate2). This script never imports torch.

Greedy decoding of a batch: every row is a sequence of its own in one llama_batch (the prompt pass, then one
token per row and step), the argmax of each row's logits in NumPy, exactly ``new_tokens`` new tokens (EOS is
not treated as an end, as min_new_tokens does on the other providers).

llama.cpp's AMX build (on Xeons with AMX-INT8; GGML_NATIVE turns it on) repacks the Q4_1 linears into an extra
buffer type whose llama_decode crashes (SIGSEGV) on any batch of more than one token in 0.3.36 (seen on a 2-core
Sapphire-Rapids-class VM: prompts of 2, 8 and 32 tokens), so there the worker loads without extra buffer types
and says so in its load reply; one token at a time the AMX path ran 8.0-8.7 ms a token against 12.0-12.9 without.

Requests (benchmarks/_worker_loop.py): ("load", gguf_path, threads, context, rows) -> llama.cpp's settings of note;
("generate", token_rows, new_tokens) -> new token ids.
"""

import ctypes

import llama_cpp
import numpy as np
from _worker_loop import serve


# llama.cpp logs every load and context at length; the benchmark reports what it needs.
QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)


def amx_build() -> bool:
    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


class Greedy:
    def __init__(self, path: str, threads: int, context: int, rows: int):
        llama_cpp.llama_log_set(QUIET, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        amx = amx_build()
        model_params.use_extra_bufts = not amx
        self.settings = {"extra_buffer_types": not amx, "amx": amx}
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = context * rows, context * rows, 512, rows
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        if not self.context:
            raise RuntimeError("llama.cpp could not make a context")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(context * rows, 0, rows)

    def _decode(self, entries) -> None:
        """entries: (token, position, sequence, wants logits) each."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for index, (token, position, sequence, logits) in enumerate(entries):
            batch.token[index], batch.pos[index], batch.n_seq_id[index] = token, position, 1
            batch.seq_id[index][0], batch.logits[index] = sequence, logits
        status = llama_cpp.llama_decode(self.context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, index: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(self.context, index)
        return int(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.vocab,)).argmax())

    def generate(self, token_rows: list, new_tokens: int) -> list:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context), True)
        entries = [(token, position, row, position == len(tokens) - 1)
                   for row, tokens in enumerate(token_rows) for position, token in enumerate(tokens)]
        self._decode(entries)
        last = [index for index, entry in enumerate(entries) if entry[3]]
        new = [[self._argmax(index)] for index in last]
        for step in range(1, new_tokens):
            self._decode([(ids[-1], len(tokens) + step - 1, row, True)
                          for row, (tokens, ids) in enumerate(zip(token_rows, new))])
            for row, ids in enumerate(new):
                ids.append(self._argmax(row))
        return new


def main() -> None:
    runner = None

    def handle(request):
        nonlocal runner
        if request[0] == "load":
            runner = Greedy(*request[1:])
            return runner.settings
        return runner.generate(*request[1:])

    serve(handle)


if __name__ == "__main__":
    main()
