"""The names of the run settings a stage worker acts on, defined once for the partitioner's
``Workload`` (which predicts them), the runtime's ``RunSpec`` (which runs them) and the CLI."""

# gradient synchronization between a stage's replicas: FuncPipe's pipelined scatter-reduce,
# or LambdaML's scatter-reduce without pipelining (runtime.collectives)
SYNC_METHODS = ("pipelined", "lambdaml")
# "bf16"/"fp16": stages compute under autocast (float32 master weights and optimizer state) and
# the tensors crossing stage boundaries travel as bfloat16/float16; fp16 scales its loss
# (runtime.precision)
PRECISIONS = ("fp32", "bf16", "fp16")
# the precisions that train with a loss scaler (a step is skipped where a gradient overflowed)
SCALED_PRECISIONS = ("fp16",)
# what a NaN or infinity in the data or in an iteration's loss does: a warning, a stop (the run
# stays resumable), or nothing (backends.batch_checks)
NON_FINITE = ("warn", "error", "ignore")
