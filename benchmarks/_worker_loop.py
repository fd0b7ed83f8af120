"""The request loop of the engine workers (benchmarks/_ct2_worker.py, _llama_worker.py), which never import torch.

Pickled requests on stdin, one pickled reply each on stdout; ("stop",), or the parent closing the pipe, ends it. A
request that raises replies ("error", message), and the worker keeps serving.
"""

import pickle
import sys


def serve(handle) -> None:
    """``handle(request) -> reply`` for every request but the stop."""
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        if request[0] == "stop":
            return
        try:
            reply = handle(request)
        except Exception as error:  # the parent reports it
            reply = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(reply, replies)
        replies.flush()
