"""Every constant of the simulator, with where it comes from.

Tags: [paper] the authors' paper or artifact code; [paper*] an author's number relayed by a
secondary source; [vendor] a third party with a product; [inferred] arithmetic or a modelling
choice of ours; [measured] this project's benchmarks (benchmarks/results/*.json, read at run time
by `costs.py` unless overridden). Constants are fixed before any comparison with a published result.
"""

from __future__ import annotations

HOUR = 3600.0

# -- failure scenarios ---------------------------------------------------------------------------
SCENARIOS = {
    # MeCeFO paper, 32 GPUs: a cluster-wide failure every 2 / 1 / 0.5 h, repaired in 4 / 3 / 2 h [paper]
    "low": {"gpus": 32, "mtbf_hours": 2.0, "repair_hours": 4.0},
    "medium": {"gpus": 32, "mtbf_hours": 1.0, "repair_hours": 3.0},
    "high": {"gpus": 32, "mtbf_hours": 0.5, "repair_hours": 2.0},
}
META_RSC1_PER_1000_NODE_DAYS = 6.50  # Meta, "Revisiting Reliability" (arXiv 2410.21680), RSC-1 [paper*]
META_RSC2_PER_1000_NODE_DAYS = 2.34  # the same, RSC-2 [paper*]
LLAMA3_INTERRUPTIONS = (419, 54 * 24.0, 16_384)  # unexpected interruptions, hours, GPUs (arXiv 2407.21783) [paper*]
LLAMA3_PER_1000_NODE_DAYS = 1000 * 419 / (54 * 16_384 / 8)  # 3.79 per 8-GPU node [inferred]
CLUSTER_REPAIR_HOURS = 4.0  # a failed node back in the pool: the paper's low scenario's 4 h [inferred]
# cluster-scale presets: 8-GPU nodes (the failure domain), the GPU count of the source
SCENARIOS.update({
    "llama3": {"gpus": 16_384, "gpus_per_node": 8, "failures_per_1000_node_days": LLAMA3_PER_1000_NODE_DAYS,
               "repair_hours": CLUSTER_REPAIR_HOURS},
    "meta-rsc1": {"gpus": 16_384, "gpus_per_node": 8, "failures_per_1000_node_days": META_RSC1_PER_1000_NODE_DAYS,
                  "repair_hours": CLUSTER_REPAIR_HOURS},
    "meta-rsc2": {"gpus": 8_192, "gpus_per_node": 8, "failures_per_1000_node_days": META_RSC2_PER_1000_NODE_DAYS,
                  "repair_hours": CLUSTER_REPAIR_HOURS},
})

# -- checkpoint-restart ----------------------------------------------------------------------------
CKPT_WRITE_S = 300.0  # blocking save; Meta's E[ETTR] model assumes 5 min [paper*]
RESTART_S = 600.0  # detect + reschedule + init + load: Meta assumes 5 min restart + load [paper*]; 10 min total [inferred]
INMEMORY_CKPT_WRITE_S = 1.0  # Gemini / CheckFreq style snapshot to CPU memory, per checkpoint [inferred from paper claims]
INMEMORY_RESTART_S = 150.0  # FlashRecovery: 150 s at 4,800 devices (arXiv 2509.03047) [paper]

# -- NVRx in-process restart (Megatron --inprocess-restart) -------------------------------------
NVRX_RESTART_S = 0.5 + 1.0 + 0.5 + 0.5 + 60.0  # destroy PG, last_call_wait, rank assignment, barrier, + rebuild/load [paper + inferred]

# -- in-job restart from replicated local checkpoints (NVRx launcher, Megatron --non-persistent-ckpt-type local --replication)
LOCAL_CKPT_INTERVAL_S = 600.0  # a local checkpoint every ~10 min (cheap, asynchronous) [inferred]
LOCAL_CKPT_OVERHEAD = 1.0  # asynchronous writes hidden behind compute [inferred]
NVRX_INJOB_RESTART_S = 120.0  # process restart + init + load from a local / peer copy [inferred]

# -- model sizes and the interconnect (MeCeFO's re-shard of a sharded optimizer) ----------------
MODEL_PARAMS = {"350M": 0.35e9, "1B": 1.0e9, "7B": 7.0e9}
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master + AdamW moments [inferred]
PEER_BYTES_PER_S = 25e9  # 200 Gb/s per GPU (one InfiniBand HDR port) [inferred]

# -- spares and replicated optimizer state (HyperPod checkpointless, MindSpeed replica optimizer) -
SPARE_SWAP_S = 60.0  # a warm spare joins and receives the state from a replica [inferred]

# -- Bamboo (NSDI'23) -----------------------------------------------------------------------------
BAMBOO_FALLBACK_SLOWDOWN = 1.5  # step time while a predecessor runs a lost stage, sim constant [paper]
BAMBOO_RECONFIG_S = {"350M": 100.0, "1B": 230.0, "7B": 450.0}  # Oobleck's measurements of Bamboo's re-rendezvous for GPT-3 350M / 2.7B / 6.7B [paper]
BAMBOO_PIPELINE_STAGES = 4  # [inferred]: the paper's setup is not reproduced here
BAMBOO_FAILURE_FREE = {"350M": 0.62, "1B": 0.53, "7B": 0.19}  # Bamboo / Oobleck failure-free throughput, MeCeFO's table [paper]

# -- Oobleck (SOSP'23) ----------------------------------------------------------------------------
OOBLECK_RECONFIG_S = {"350M": 3.0, "1B": 6.0, "7B": 10.0}  # artifact: 3 / 6 / 10 s for GPT-3 350M / 2.7B / 6.7B [paper]
OOBLECK_FAULT_THRESHOLD = 3  # f + 1 pipelines survive any f failures; default in code [paper]
# The artifact's own BERT-large setup (SymbioticLab/Oobleck, sosp23-artifact, tools/simulator): a
# global batch of 8192 samples, measured samples/s for 30 down to 15 nodes, a 2 s local rendezvous
# per removal, one in-flight step lost per removal, and its README's time shares on the 10-minute
# trace (30 nodes, one removed every 601.2 s) [paper]
OOBLECK_ARTIFACT_BERT_LARGE = {
    "samples_per_step": 8192,
    "samples_per_s": dict(zip(range(30, 14, -1), (
        368.2457947, 362.2151579, 328.35419, 327.7784909, 329.1392983, 307.2134406, 304.4540075, 278.5264442,
        285.8442276, 260.3144683, 261.6788898, 243.5568988, 228.0545262, 209.2082907, 214.8045205, 192.304776))),
    "reconfig_s": 2.0,
    "shares_10m": {"effective": 0.9551596805322267, "rebalance": 0.00310802596942179, "fallback": 0.04173229349835156},
}

# -- torchft ----------------------------------------------------------------------------------------
TORCHFT_DETECT_S = 5.0  # lighthouse heartbeat_timeout_ms 5000 [paper]
TORCHFT_HEAL_S = 60.0  # process restart (>= 30 s) + join + state transfer [inferred]; a user saw 948 s on 8B [issue]
TORCHFT_OVERHEAD = 1.0  # steady-state slowdown: no official number [unk]; 1.0 keeps it out of the comparison

# -- ReCoVer (arXiv 2605.11215) --------------------------------------------------------------------
RECOVER_TRANSITION_S = 5.0  # "seconds + partial step" [inferred]

# -- ReCycle (SOSP'24) ------------------------------------------------------------------------------
RECYCLE_BUBBLE_ABSORBED = 1.0  # share of the 1F1B bubble the extra micro-batches fill (ideal) [inferred]
RECYCLE_TRANSITION_S = 5.0  # the planner's precomputed schedules: seconds [inferred]
MICRO_BATCHES = 8  # micro-batches per replica and step (ReCycle's bubbles, MeCeFO's spread) [inferred]

# -- MeCeFO: the paper's own throughput drops at its high scenario --------------------------------
PAPER_DROP = {"350M": 0.0107, "1B": 0.0298, "7B": 0.0418}  # [paper]
PAPER_BAMBOO_DROP = {"350M": 0.0704, "1B": 0.0821, "7B": 0.2084}  # [paper]
PAPER_OOBLECK_DROP = {"350M": 0.1014, "1B": 0.1387, "7B": 0.2809}  # [paper]

# -- fail-slow (sim/failslow.py) -------------------------------------------------------------------
# FALCON / Greyhound (arXiv 2410.12588, USENIX ATC '25), a 10,000-GPU production cluster: fail-slows
# last "from tens of seconds to nearly ten hours" and delay the average job's completion by 1.34x [paper]
FAILSLOW_DURATION_S = (30.0, 10 * HOUR)  # log-uniform over that range [inferred: the shape is ours]
FALCON_JCT_DELAY = 1.34  # the rate is calibrated so the unmitigated 1,024-GPU job is this slow [paper]
FAILSLOW_SEVERITY = (1.1, 3.0)  # log-uniform slowdown factor [inferred: the study's distribution unreachable;
#                                 Greyhound's artifact injects 10-30 % by locking GPU clocks]
FAILSLOW_JOB_WIDE_SHARE = 0.5  # episodes slowing every replica (a congested DP link) [inferred: FALCON names
#                                computation and network causes, the split unreachable; 0.0 also reported]
