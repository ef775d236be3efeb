"""Private tooling around the vLLM oracle: the synthetic serving trace both sides
generate (:mod:`.trace`) and the replay of operation dumps recorded from vLLM's own
manager (:mod:`.replay`). Used by the differential tests and the benchmarks; not
part of the public API.
"""
