"""Other inference engines that specdraft drives across a process boundary (each lives in its own virtual
environment, built by ``make engines``): :mod:`specdraft.engines.vllm`."""
