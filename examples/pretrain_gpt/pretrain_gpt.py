"""Pretrain a GPT with Megatron-Core + DeepSpeed, optionally fault tolerant with MeCeFO.

    # 4 ranks on CPU, MeCeFO on, rank 1 killed at step 50 and restarted (it rejoins):
    mecefo-launch --nproc-per-node 4 --restart-failed-after 10 examples/pretrain_gpt/pretrain_gpt.py \\
        --deepspeed_config examples/pretrain_gpt/ds_config.json --mecefo --mecefo-inject kill:1:50 \\
        --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 4 --global-batch-size 32 --train-iters 200 --lr 1e-3 --normalization RMSNorm --swiglu \\
        --position-embedding-type rope --eval-interval 50 --eval-iters 4 --save runs/ckpt --save-interval 100
    # the same with DeepSpeed's launcher:  deepspeed --num_gpus 4 examples/pretrain_gpt/pretrain_gpt.py ...
    # tensor x pipeline parallel: --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    #   (world = T x P x D, Megatron's rank order; a failed rank takes its replica out until it is back)
    # real data: python -m megatron_mecefo.data.preprocess --input corpus.jsonl --output-prefix data/c ; --data-path data/c

Without --mecefo this is plain DeepSpeed data-parallel training (Megatron-Core's schedules and
parallel_state for tensor and pipeline parallelism). Without --data-path it trains on
the Python standard library's sources (byte-level tokens, built once into a cache).
"""

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
warnings.filterwarnings("ignore")

import torch
import torch.nn.functional as F

from megatron_mecefo.config import MeCeFOConfig
from megatron_mecefo.errors import run_to_exit


def parse_args(argv=None):
    from megatron_mecefo.data import TOKENIZERS

    p = argparse.ArgumentParser(description="GPT pretraining with MeCeFO")
    a = p.add_argument
    a("--num-layers", type=int, default=2); a("--hidden-size", type=int, default=128)
    a("--num-attention-heads", type=int, default=4); a("--ffn-hidden-size", type=int, default=None)
    a("--seq-length", type=int, default=128); a("--max-position-embeddings", type=int, default=None)
    # flags that have a ds_config counterpart default to None: not given, ds_config's value (or FLAG_DEFAULTS) holds
    a("--micro-batch-size", type=int, default=None); a("--global-batch-size", type=int, default=None)
    a("--train-iters", type=int, default=100); a("--lr", type=float, default=None)
    a("--min-lr", type=float, default=0.0); a("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    a("--lr-warmup-iters", type=int, default=0); a("--weight-decay", type=float, default=None)
    a("--clip-grad", type=float, default=None); a("--bf16", action="store_true", default=None); a("--seed", type=int, default=1234)
    a("--overlap-grad-reduce", action="store_true", default=None,
      help='reduce the gradients in buckets during the last micro-batch\'s backward (ds_config "zero_optimization.overlap_comm")')
    a("--ddp-bucket-size", type=int, default=None, help='elements per bucket (ds_config "zero_optimization.reduce_bucket_size")')
    a("--eval-interval", type=int, default=100); a("--eval-iters", type=int, default=10)
    a("--log-interval", type=int, default=10)
    a("--save", default=None); a("--load", default=None); a("--save-interval", type=int, default=None)
    a("--data-path", default=None, help="prefix of a .bin/.idx indexed dataset (default: the stdlib corpus)")
    a("--split", default="98,2,0"); a("--tokenizer-type", choices=TOKENIZERS, default="ByteTokenizer",
      help="ByteTokenizer (UTF-8 bytes; the stdlib corpus and our preprocess), or NullTokenizer: ids as they are "
           "in --data-path, with --vocab-size (data made by Megatron's tools/preprocess_data.py)")
    a("--vocab-size", type=int, default=None, help="NullTokenizer: the vocabulary size of the tokenizer that made the data")
    a("--make-vocab-size-divisible-by", type=int, default=64)
    a("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm"); a("--swiglu", action="store_true")
    a("--disable-bias-linear", action="store_true")
    a("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    a("--share-embeddings-and-output-weights", action="store_true",
      help="tie the output layer to the input embedding (Megatron-LM's default; this example unties them unless set)")
    a("--hidden-dropout", type=float, default=0.0); a("--attention-dropout", type=float, default=0.0)
    a("--tensor-model-parallel-size", type=int, default=1); a("--pipeline-model-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (needs --tensor-model-parallel-size > 1)")
    a("--local_rank", "--local-rank", type=int, default=0)
    a("--perturb-loss", default=None, metavar="STEP:SCALE",
      help="multiply the loss of step STEP's first micro-batch by SCALE (e.g. 25:1.001): a negligible change of one "
           "step's gradient (its direction: a uniform scale would be undone by clipping and Adam), the control that "
           "measures run-to-run noise in benchmarks/convergence.py")
    # DeepSpeed's own two flags (what deepspeed.add_config_arguments adds), declared here so that bad
    # input ends before `import deepspeed` and Megatron-Core (seconds per rank)
    g = p.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", action="store_true", help="Enable DeepSpeed (helper flag for user code)")
    g.add_argument("--deepspeed_config", default=None, help="DeepSpeed json configuration file.")
    MeCeFOConfig.add_cli_args(p)
    args = p.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.perturb_loss is not None:
        try:
            step, scale = args.perturb_loss.split(":")
            args.perturb_loss = (int(step), float(scale))
        except ValueError:
            p.error(f"--perturb-loss must be STEP:SCALE (e.g. 25:1.001), got {args.perturb_loss!r}")
    return args


def read_ds_config(args):
    import json

    if not args.deepspeed_config:
        return {}
    with open(args.deepspeed_config) as f:
        return json.load(f)


FLAG_DEFAULTS = {"micro_batch_size": 4, "lr": 1e-3, "weight_decay": 0.01, "clip_grad": 1.0, "bf16": False,
                 "overlap_grad_reduce": False, "ddp_bucket_size": 500_000_000}
"""Used when neither the flag nor ds_config sets the value."""


def _settle(args, name, cfg, path, flag):
    """One value both a flag and ds_config can set: the flag if given (ds_config must agree), else
    ds_config's, else FLAG_DEFAULTS. Written back to both."""
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    given = getattr(args, name)
    if given is not None and path[-1] in node and node[path[-1]] != given:
        raise ValueError(f'{flag} {given} conflicts with ds_config "{".".join(path)}"={node[path[-1]]}: '
                         "set it in one place, or make them agree")
    value = given if given is not None else node.get(path[-1], FLAG_DEFAULTS[name])
    setattr(args, name, value)
    node[path[-1]] = value


def ds_config_for(args, world):
    """The ds_config file (if any) completed by the Megatron-style flags. A flag and a ds_config key
    that set the same thing must agree (a conflict is an error); either alone decides."""
    cfg = read_ds_config(args)
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"betas": [0.9, 0.95], "torch_adam": True}})
    _settle(args, "micro_batch_size", cfg, ("train_micro_batch_size_per_gpu",), "--micro-batch-size")
    _settle(args, "lr", cfg, ("optimizer", "params", "lr"), "--lr")
    _settle(args, "weight_decay", cfg, ("optimizer", "params", "weight_decay"), "--weight-decay")
    _settle(args, "clip_grad", cfg, ("gradient_clipping",), "--clip-grad")
    _settle(args, "bf16", cfg, ("bf16", "enabled"), "--bf16")
    _settle(args, "overlap_grad_reduce", cfg, ("zero_optimization", "overlap_comm"), "--overlap-grad-reduce")
    _settle(args, "ddp_bucket_size", cfg, ("zero_optimization", "reduce_bucket_size"), "--ddp-bucket-size")
    if args.global_batch_size is None and "train_batch_size" in cfg:
        args.global_batch_size = cfg["train_batch_size"]
    gbs = args.global_batch_size or args.micro_batch_size * world
    if gbs % (args.micro_batch_size * world):
        raise ValueError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size x ranks ({args.micro_batch_size * world})")
    want = {"train_batch_size": gbs, "gradient_accumulation_steps": gbs // (args.micro_batch_size * world)}
    for key, value in want.items():
        if key in cfg and cfg[key] != value:
            raise ValueError(f'ds_config "{key}"={cfg[key]} conflicts with the flags ({value})')
        cfg[key] = value
    cfg.setdefault("steps_per_print", 10 ** 9)
    return cfg


def check_layout(args, world):
    """Tensor/pipeline-parallel sizes that cannot run end here (ValueError: exit 2), before training."""
    t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if t < 1 or p < 1 or world % (t * p):
        raise ValueError(f"the world of {world} ranks is not divisible by --tensor-model-parallel-size ({t}) x "
                         f"--pipeline-model-parallel-size ({p})")
    if args.num_layers % p:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {p}")
    if args.num_attention_heads % t:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                         f"--tensor-model-parallel-size {t}")
    ffn = args.ffn_hidden_size or (None if args.swiglu else 4 * args.hidden_size)
    if ffn is not None and ffn % t:
        raise ValueError(f"the FFN hidden size {ffn} is not divisible by --tensor-model-parallel-size {t}")
    if args.sequence_parallel and t == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % t:
        raise ValueError(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                         f"--tensor-model-parallel-size {t}")
    return world // (t * p)


def lr_lambda(args):
    def f(it):
        if it < args.lr_warmup_iters:
            return (it + 1) / args.lr_warmup_iters
        frac = min(1.0, (it - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters))
        decay = {"constant": 1.0, "linear": 1.0 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac))}[args.lr_decay_style]
        return (args.min_lr + (args.lr - args.min_lr) * decay) / args.lr
    return f


def build_model(args):
    from megatron_mecefo.data.tokenizer import build_tokenizer
    from megatron_mecefo.layers.model import build_gpt, llama_config

    d = args.make_vocab_size_divisible_by
    vocab = -(-build_tokenizer(args.tokenizer_type, args.vocab_size).vocab_size // d) * d
    config = llama_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size or (None if args.swiglu else 4 * args.hidden_size),
        normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu, add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        dtype=torch.bfloat16 if args.bf16 else torch.float32, sequence_parallel=args.sequence_parallel,
    )
    return build_gpt(config, vocab_size=vocab, seq_length=args.max_position_embeddings, seed=args.seed,
                     position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=args.share_embeddings_and_output_weights)


def lm_loss(engine, batch):
    tokens, pos, labels, mask = batch
    per_token = engine(tokens, pos, None, labels=labels).float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def forward_step(data_iterator, model):
    """Megatron's forward_step: this stage's output and the loss function (used on the last stage)."""
    tokens, pos, labels, mask = next(data_iterator)
    output = model(tokens, pos, None, labels=labels)
    return output, lambda out: ((out.float() * mask).sum() / mask.sum().clamp(min=1), {})


def evaluate(model, valid, args, sharded=False):
    """Mean validation loss; with tensor/pipeline parallelism every rank of the replica calls it and
    the last stage gets the value (None elsewhere)."""
    from megatron_mecefo.data.gpt import collate
    from megatron_mecefo.deepspeed_hook.schedule import forward_backward

    batches = [collate(valid, range(i * args.micro_batch_size, (i + 1) * args.micro_batch_size)) for i in range(args.eval_iters)]
    model.eval()
    with torch.no_grad():
        if sharded:
            losses = forward_backward(model, forward_step, batches, num_microbatches=len(batches), seq_length=args.seq_length,
                                      micro_batch_size=args.micro_batch_size, forward_only=True)
        else:
            losses = []
            for tokens, pos, labels, mask in batches:
                out = model(tokens, pos, None, labels=labels).float()
                losses.append(((out * mask).sum() / mask.sum()).item())
    model.train()
    return sum(losses) / len(losses) if losses else None


def save_checkpoint(engine, args, iteration, quiet=False):
    """DeepSpeed's checkpoint layout (save/global_step{N}/, `latest`), as Megatron-DeepSpeed writes it,
    plus Megatron's latest_checkpointed_iteration.txt. The same function writes the checkpoint of a
    job that gives up (initialize(save_dir=...))."""
    from megatron_mecefo.deepspeed_hook import save_checkpoint as ds_save

    ds_save(engine, args.save)
    if not quiet:
        print(f" saved checkpoint at iteration {iteration:8d} to {args.save}", flush=True)


def main(argv=None):
    args = parse_args(argv)
    mecefo = MeCeFOConfig.from_args(args, read_ds_config(args).get("mecefo"))  # validated before anything starts
    from megatron_mecefo.config import LaunchEnv, cache_root

    env = LaunchEnv.read()
    dp = check_layout(args, env.world)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sharded = tp * pp > 1
    if sharded and args.perturb_loss:
        raise ValueError("--perturb-loss needs tensor and pipeline parallel size 1")
    ds_config = ds_config_for(args, dp)
    if mecefo.enable:
        from megatron_mecefo.elastic.faults.inject import check_job

        mecefo.check_ds_config(ds_config)
        # bad failure rules or traces end here, before any data or model is built
        check_job(mecefo, env.world, model_parallel=tp * pp, train_iters=args.train_iters,
                  max_restarts=mecefo.restarts(env))
    # the checks above import neither DeepSpeed nor Megatron-Core: bad input ends in about a second
    from megatron_mecefo.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_size)
    if args.tokenizer_type == "ByteTokenizer" and args.vocab_size is not None:
        raise ValueError("--vocab-size is for --tokenizer-type NullTokenizer (the ByteTokenizer has 258 ids)")
    if args.data_path is None and args.tokenizer_type != "ByteTokenizer":
        raise ValueError("--tokenizer-type NullTokenizer needs --data-path (the built-in corpus is byte tokens)")
    from megatron_mecefo.data.corpus import stdlib_corpus
    from megatron_mecefo.data.gpt import build_gpt_datasets, collate
    from megatron_mecefo.elastic.plan.fold import sample_range
    from megatron_mecefo.layers.model import init_model_parallel

    if mecefo.enable:
        from megatron_mecefo.deepspeed_hook import init_distributed

        init_distributed(tensor_parallel=tp, pipeline_parallel=pp, timeout_s=mecefo.collective_timeout_s,
                         join_timeout_s=mecefo.join_timeout_s, heartbeat_timeout_s=mecefo.heartbeat_timeout_s,
                         log_dir=mecefo.log_dir, restart_failed_after=mecefo.restart_failed_after,
                         max_restarts=mecefo.max_restarts, store=mecefo.store)
    else:
        import deepspeed

        from megatron_mecefo.deepspeed_hook.initialize import cpu_shm_build_skipped
        from megatron_mecefo.elastic.comm.groups import default_backend

        with cpu_shm_build_skipped():
            deepspeed.init_distributed(default_backend())
    prefix = args.data_path or stdlib_corpus()
    gbs, k = ds_config["train_batch_size"], ds_config["gradient_accumulation_steps"]
    train, valid = build_gpt_datasets(prefix, seq_length=args.seq_length, split=args.split, seed=args.seed,
                                      train_samples=args.train_iters * gbs, valid_samples=args.eval_iters * args.micro_batch_size,
                                      cache_dir=os.path.join(cache_root(), "index-cache"), tokenizer=tokenizer)
    init_model_parallel(tp, pp, seed=args.seed, timeout_s=mecefo.collective_timeout_s if mecefo.enable else 1800.0)
    model = build_model(args)
    sched = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))  # noqa: E731
    if mecefo.enable:
        from megatron_mecefo.deepspeed_hook import initialize

        ds_config["mecefo"] = mecefo.to_dict()
        engine = initialize(model=model, config=ds_config, mecefo=mecefo, lr_scheduler=sched, train_iters=args.train_iters,
                            save_dir=args.save, load_dir=args.load)  # loads before the runtime starts; not on a restart
        rt = engine.runtime
    else:
        import deepspeed

        from megatron_mecefo.deepspeed_hook.mpu import MegatronMPU

        if sharded:  # Megatron-Core's schedule runs the micro-batches and the loop clips; DeepSpeed steps
            clip = ds_config.pop("gradient_clipping", 0.0)

        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config, mpu=MegatronMPU(), lr_scheduler=sched,
                                               model_parameters=model.parameters())
        rt = None
        if args.load:
            from megatron_mecefo.deepspeed_hook import load_checkpoint

            load_checkpoint(engine, args.load)
    from megatron_mecefo.deepspeed_hook.schedule import clip_grad_norm, forward_backward, reduce_tied_embeddings
    from megatron_mecefo.elastic.plan.topology import Grid

    grid = Grid(tp=tp, pp=pp, dp=dp)
    _, _, my_replica = grid.coords(env.rank)
    # Megatron prints from the last stage; here: tp rank 0, last stage, of the lowest live replica
    lead_replica = lambda: min(rt.cover_map().live) if rt else 0  # noqa: E731
    is_logger = lambda: env.rank == grid.rank(0, pp - 1, lead_replica())  # noqa: E731
    if rt is not None and is_logger() and not rt.rejoined:
        print(engine.driver.banner(engine.global_steps), flush=True)
    t_last, losses = time.monotonic(), []
    batch_of = lambda it, replica, index: collate(train, sample_range(  # noqa: E731
        it, replica, index, micro_batch_size=args.micro_batch_size, dp=dp, k=k))
    while engine.global_steps < args.train_iters:
        it = engine.global_steps
        if sharded and rt is not None:
            stepped = engine.train_step(forward_step, lambda mb: batch_of(it, mb.replica, mb.index), seq_length=args.seq_length)
        elif sharded:  # plain: Megatron's schedule, DeepSpeed's data-parallel averaging, clip, step
            losses = forward_backward(engine.module, forward_step, (batch_of(it, my_replica, j) for j in range(k)),
                                      num_microbatches=k, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                      sum_gradients=False)
            reduce_tied_embeddings(engine.module)
            engine.set_gradient_accumulation_boundary(True)  # the schedule's backward bypassed engine.backward
            engine.allreduce_gradients()
            clip_grad_norm(engine.module, clip)
            engine.step()
            stepped = True
        else:
            mbs = [(m.replica, m.index) for m in engine.micro_batches()] if rt else [(env.rank, j) for j in range(k)]
            for replica, index in mbs:
                loss = lm_loss(engine, batch_of(it, replica, index))
                if args.perturb_loss and it == args.perturb_loss[0] and (replica, index) == (0, 0):
                    loss = loss * args.perturb_loss[1]
                engine.backward(loss)
                losses.append(loss.item())
                stepped = engine.step()
        if rt is not None and not stepped:
            losses = []
            continue  # a peer failed: the survivors regrouped; redo this iteration
        it = engine.global_steps
        if is_logger() and it % args.log_interval == 0:
            lm = engine.last_loss if rt else sum(losses) / len(losses)
            live = rt.cover_map().live if rt else ()
            state = f" | mecefo: gen {rt.generation} live {len(live)}/{dp} cover {rt.cover_plan().text()}" if rt else ""
            print(f" iteration {it:8d}/{args.train_iters:8d} | consumed samples: {it * gbs:12d} | elapsed time per iteration (ms): "
                  f"{1000 * (time.monotonic() - t_last) / args.log_interval:8.1f} | learning rate: {engine.get_lr()[0]:.6E} | "
                  f"global batch size: {gbs:5d} | lm loss: {lm:.6E}{state} |", flush=True)
            t_last = time.monotonic()
        losses = []
        in_lead = my_replica == lead_replica()  # with tp/pp the whole replica runs the evaluation and the save
        if (is_logger() or (sharded and in_lead)) and (it % args.eval_interval == 0 or it == args.train_iters):
            value = evaluate(engine.module, valid, args, sharded=sharded)
            if is_logger():
                print(f" validation loss at iteration {it} | lm loss value: {value:.6E} |", flush=True)
        # plain DeepSpeed: every rank calls save_checkpoint (it has barriers); MeCeFO: one replica writes,
        # and with a sharded optimizer state (zero stage 1) every rank writes its shards beside it
        if args.save and ((args.save_interval and it % args.save_interval == 0) or it == args.train_iters):
            if rt is None or in_lead:
                save_checkpoint(engine, args, it, quiet=not is_logger())
            if rt is not None:
                engine.save_shards(args.save)
    if rt is not None:
        engine.close()
        # the outcome is recorded and every line printed; skip interpreter teardown, where C++
        # destructors of process groups whose peers died (past generations) can std::terminate
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    from megatron_mecefo.elastic.launch.keeper import keep_early

    keep_early(sys.argv[1:])  # deepspeed / torchrun / by hand with --mecefo: this process keeps the rank
    # how a MeCeFO job ends -> exit codes: 3 gave up, 4 left the job (restarted), 2 bad input
    # (a flag, a store of another job, a bad checkpoint)
    run_to_exit(main, usage=(ValueError, FileNotFoundError))
