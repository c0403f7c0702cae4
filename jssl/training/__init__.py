"""The training step and what it carries: the compiled step (``step``), the TrainState
(``state``), the run's plan and position (``progress``), its host batches
(``batches``), the finiteness check of the state
(``finite``), preemption (SIGTERM, Ctrl-C), the online linear probe and the summaries the train
engine writes. Nothing here imports an engine or an evaluator."""
