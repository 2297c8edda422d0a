"""A soak: drive a running server for a while with a seeded mix of traffic, then check it from outside.

- options.py: what to run and the bounds it must hold;
- oracle.py: what each request must return (exact ids and text on a designed preset);
- traffic.py: the mix, through the official openai client and raw HTTP;
- watch.py: /health polled throughout, /metrics read for the server's own ledger, memory and cells;
- report.py: outcomes, the end-of-run checks, the table and the JSON document; driver.py: one run.

Run it with `scripts/soak.py` (it needs the openai client, in the test extras).
"""
