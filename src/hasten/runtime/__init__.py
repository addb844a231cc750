"""What runs under the training loop in every process: collectives and nested-structure operations, random states,
memory and OOM recovery, the hang watchdog, debug mode, preemption, wrappers, availability probes."""
