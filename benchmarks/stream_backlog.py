"""What a server's streams hold for clients that stop reading; see
tokenmill/bench/stream_backlog.py.

    python benchmarks/stream_backlog.py [--model PATH] [--requests 64] [--max-tokens 512]
                                        [--logprobs 5] [--output-kind delta]
"""

from tokenmill.bench.stream_backlog import main

if __name__ == "__main__":
    raise SystemExit(main())
