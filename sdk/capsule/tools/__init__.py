"""CLI-only modules: what `capsule demo | doctor | inspect | verify | repair | bench` run.

capsule.cli imports each of these lazily, inside its command. Nothing in the runtime imports
this package (tests/test_rooms.py checks it), so `import capsule` never pays for them:

    demo.py          `capsule demo`: a short end-to-end run with timings
    doctor.py        `capsule doctor`: which backends work here (a tiny real inference each)
    store_report.py  `capsule inspect` / `verify`: read a store without loading a model
    repair.py        `capsule repair`: rebuild a store's index from its segment log
    bench/           `capsule bench --suite ...`: the benchmark suites
"""
