@0x84182cf06b396eb0;
# The wire between llmgw-agent and llmgw-cp.
#
# Structs mirror the attrs classes in llmgw/model.py field for field
# (snake_case there, camelCase here); llmgw/rpc/_codec.py converts by name.
#
# Absent is not zero: a number that can be unknown is a pointer to an Opt*
# struct, null when unknown; text and lists that can be unknown are null
# pointers. An agent older than a field leaves it null, which reads as unknown.
# Add fields only at the end of a struct, with the next ordinal; never reuse one.

struct OptI64 { v @0 :Int64; }
struct OptF64 { v @0 :Float64; }

# --- Hardware inventory ---------------------------------------------------------

struct Gpu {
  index @0 :Int32;
  uuid @1 :Text;
  name @2 :Text;
  gpuClass @3 :Text;
  pciBusId @4 :Text;
  memoryTotalMib @5 :OptI64;
  memoryUsedMib @6 :OptI64;
  computeCapability @7 :Text;
  eccUncorrected @8 :OptI64;
  utilizationPct @9 :OptF64;
  foreignMemoryMib @10 :OptI64;
  numaNode @11 :OptI64;
  cpuAffinity @12 :Text;
  migMode @13 :Text;  # "enabled" / "disabled"; null: unknown
  migPending @14 :Text;  # the mode after the next GPU reset, when it differs
  migDevices @15 :List(MigDevice);
}

struct MigDevice {
  uuid @0 :Text;  # MIG-...
  profile @1 :Text;  # 3g.40gb
  memoryMib @2 :OptI64;
  gpuInstance @3 :OptI64;
  computeInstance @4 :OptI64;
}

struct NvLink { a @0 :Int32; b @1 :Int32; links @2 :Int32; }

struct NicDistance { gpu @0 :Int32; nic @1 :Text; distance @2 :Text; }

struct Topology {
  nvlinks @0 :List(NvLink);
  nicDistances @1 :List(NicDistance);
}

struct IbPort {
  number @0 :Int32;
  state @1 :Text;
  physState @2 :Text;
  rateGbps @3 :OptF64;
  linkLayer @4 :Text;
}

struct IbAdapter {
  name @0 :Text;
  ports @1 :List(IbPort);
  hcaType @2 :Text;
  fwVer @3 :Text;
}

struct Fabric {
  name @0 :Text;
  adapters @1 :List(Text);
  rateGbps @2 :OptF64;
  interface @3 :Text;  # the socket interface NCCL/Gloo use beside it (agent.yaml); null: none named
}

struct Host {
  hostname @0 :Text;
  osId @1 :Text;
  osLike @2 :List(Text);
  osVersion @3 :Text;
  arch @4 :Text;
  cpuModel @5 :Text;
  cpuCount @6 :OptI64;
  cpuFlags @7 :List(Text);
  driverVersion @8 :Text;
  cudaVersion @9 :Text;
}

struct Filesystem {
  mount @0 :Text;
  fstype @1 :Text;
  paths @2 :List(Text);
  totalBytes @3 :OptI64;
  freeBytes @4 :OptI64;
  shared @5 :Bool;
}

struct WeightFile { path @0 :Text; sizeBytes @1 :Int64; }

struct Weights {
  fingerprint @0 :Text;
  files @1 :List(WeightFile);
  dir @2 :Text;                # the weights directory; null: the agent fetches nothing
  unfinished @3 :List(WeightFile);  # cache entries not complete; null: not reported
}

struct Engine {
  name @0 :Text;
  path @1 :Text;
  version @2 :Text;            # null: not known (configured by hand)
  state @3 :Text;              # installed | configured
}

struct EngineStatus {
  name @0 :Text;
  state @1 :Text;              # installing | waiting | failed
  detail @2 :Text;             # the node's words, one line
  version @3 :Text;
}

struct Engines {
  found @0 :List(Engine);      # only engines that can run
  pending @1 :List(EngineStatus);
}

struct EngineArchive { variant @0 :Text; url @1 :Text; sha256 @2 :Text; }

struct EngineDecl {
  name @0 :Text;
  version @1 :Text;
  archives @2 :List(EngineArchive);
  requirement @3 :Text;        # pip requirement (vllm, sglang); null for archives
  indexUrl @4 :Text;           # null: the mirror's /simple/
}

struct EngineDecls {
  fingerprint @0 :Text;
  engines @1 :List(EngineDecl);
}

struct GpuUsage {
  index @0 :Int32;
  memoryUsedMib @1 :OptI64;
  utilizationPct @2 :OptF64;
  foreignMemoryMib @3 :OptI64;
  eccUncorrected @4 :OptI64;
  health @5 :Text;             # ok | unhealthy; null: not known (an older agent)
  faults @6 :List(GpuFault);   # null: not watched (an older agent)
}

struct GpuFault {
  kind @0 :Text;               # xid | ecc
  meaning @1 :Text;
  unusable @2 :Bool;           # the card is taken out; false: reported only
  at @3 :Float64;              # unix time the agent read it
  xid @4 :OptI64;
  source @5 :Text;             # /dev/kmsg, nvml, nvidia-smi
  line @6 :Text;               # the kernel log's line
}

struct ShardUsage {
  shardId @0 :Text;
  cpuCores @1 :OptF64;
  rssBytes @2 :OptI64;
  gpuMemoryMib @3 :OptI64;
}

struct Usage {
  memoryTotalBytes @0 :OptI64;
  memoryAvailableBytes @1 :OptI64;
  load1 @2 :OptF64;
  load5 @3 :OptF64;
  load15 @4 :OptF64;
  cpuUtilPct @5 :OptF64;
  gpus @6 :List(GpuUsage);
  filesystems @7 :List(Filesystem);
  shards @8 :List(ShardUsage);
}

struct Inventory {
  host @0 :Host;
  usage @1 :Usage;
  gpus @2 :List(Gpu);          # null: could not tell; empty: no NVIDIA cards
  topology @3 :Topology;
  ibAdapters @4 :List(IbAdapter);
  fabrics @5 :List(Fabric);
  weights @6 :Weights;         # null: nothing to report
  engines @7 :Engines;         # null: not probed; empty list: has none
  warnings @8 :List(Text);
  labels @9 :List(Label);      # from agent.yaml, for node_selector
}

struct Label { key @0 :Text; value @1 :Text; }

# --- Session ------------------------------------------------------------------------

struct ShardReport {
  shardId @0 :Text;
  model @1 :Text;
  engine @2 :Text;
  state @3 :Text;              # starting, loading, ready, failed, stopped
  port @4 :OptI64;
  pids @5 :List(Int64);
  reason @6 :Text;
  profileFingerprint @7 :Text;
  replicaId @8 :Text;          # null: started by hand, not from the catalog
  modelName @9 :Text;
  rank @10 :Int64;
  ranks @11 :Int64;
  gpus @12 :List(Text);        # UUIDs
  source @13 :Text;            # the spec's source; null: none
  seq @14 :Int64;              # the shard's report count on its agent: newer is higher; 0: unknown
  adapters @15 :List(Text);    # the spec's adapters (LoRA names, in id order)
  gpuMemoryMib @16 :OptI64;    # the spec's share of each card; null: whole cards
}

struct Hello {
  nodeId @0 :Text;
  agentVersion @1 :Text;
  inventory @2 :Inventory;
  shards @3 :List(ShardReport);  # everything the agent runs; empty is news
}

struct Heartbeat {
  seq @0 :Int64;
  usage @1 :Usage;
  weights @2 :Weights;         # only when the fingerprint changed
  engines @3 :Engines;         # only when changed
  warnings @4 :List(Text);     # null: unchanged
}

struct Settings {
  heartbeatIntervalS @0 :Float64;
  epoch @1 :Int64;
  mirrorPort @2 :OptI64;       # null: no weights mirror; else on the host the agent dialled
  mirrorTls @3 :Bool;
  engines @4 :EngineDecls;     # null: this control plane declares no engines
}

struct Progress {
  shardId @0 :Text;            # retired: a fetch shared by many shards has one progress
  doneBytes @1 :Int64;
  totalBytes @2 :OptI64;
  source @3 :Text;             # the catalog source being fetched
}

struct ProcessSpec {
  name @0 :Text;
  argv @1 :List(Text);
  env @2 :List(EnvVar);
  role @3 :Text;               # sidecar | engine
  waitHost @4 :Text;           # null: start the next process at once
  waitPort @5 :OptI64;
  waitTimeoutS @6 :Float64;
}

struct ShardSpec {
  shardId @0 :Text;
  model @1 :Text;
  engine @2 :Text;
  processes @3 :List(ProcessSpec);  # sidecars first, the engine last
  servedNames @4 :List(Text);
  servesHttp @5 :Bool;
  port @6 :OptI64;
  healthPath @7 :Text;
  modelsPath @8 :Text;
  profileFingerprint @9 :Text;
  replicaId @10 :Text;
  modelName @11 :Text;
  rank @12 :Int64;
  ranks @13 :Int64;
  gpus @14 :List(Text);
  source @15 :Text;            # fetched or checked before launch; null: nothing to do
  adapters @16 :List(Text);    # LoRA adapters held from launch, in id order
  adapterSources @17 :List(Text);  # their sources, same order: made ready as `source` is
  gpuMemoryMib @18 :OptI64;    # MiB it claims on each of its cards; null: whole cards
}

struct EnvVar { name @0 :Text; value @1 :Text; }

struct LogLine {
  source @0 :Text;             # "engine/stdout", "ray-head/stderr", ...
  text @1 :Text;
}

struct Refusal {
  path @0 :Text;
  reason @1 :Text;
  detail @2 :Text;
}

struct Reclaimed {
  removed @0 :List(Text);
  freedBytes @1 :Int64;
  refused @2 :List(Refusal);
}

struct FlagCheck {
  engine @0 :Text;
  path @1 :Text;               # null: the engine was not found
  missing @2 :List(Text);
  warnings @3 :List(Text);
}

# --- Capabilities ---------------------------------------------------------------------

interface Registry {
  # The control plane's bootstrap capability. The caller's client certificate
  # CN must equal hello.nodeId. A standby refuses with "standby; leader is
  # HOST:PORT" before reading the inventory.
  register @0 (hello :Hello, agent :Agent) -> (session :NodeSession, settings :Settings);
}

interface NodeSession {
  heartbeat @0 (beat :Heartbeat) -> ();
  shardStatus @1 (shard :ShardReport) -> ();
  progress @2 (progress :Progress) -> ();
}

interface Agent {
  # Commands carry the leader's epoch; an agent refuses one older than the
  # newest it has seen.
  startShard @0 (epoch :Int64, spec :ShardSpec) -> (shard :ShardReport);
  stopShard @1 (epoch :Int64, shardId :Text, graceS :Float64) -> ();
  # Retired, never served: a drain is the control plane's (a replacement first,
  # then stopShard with a grace; llmgw/core/_drain.py). Ordinals must stay
  # sequential, so this placeholder keeps @2; never reuse it. An agent refuses
  # it as not implemented.
  obsoleteDrain @2 (epoch :Int64, shardId :Text) -> ();
  # shardId names a log source: "agent" (the agent's own log), a shard id (all of
  # its processes), or "SHARD/PROCESS/stdout|stderr" (one of logSources). With
  # follow, the agent answers the tail at once (following: true), then pushes
  # new lines into sink as they arrive, sink.alive() after 2 s without one, each
  # push bounded at 10 s, until a push fails (the caller went away) or the
  # source ends (sink.done()). An agent that does not follow leaves following false.
  logs @3 (shardId :Text, lines :Int32, follow :Bool, sink :LogSink) -> (tail :List(LogLine), following :Bool);
  # The agent checks every path again (llmgw.core.may_delete) before unlinking.
  # (Its results were (freedBytes, refused) before any agent implemented it.)
  reclaim @4 (epoch :Int64, paths :List(Text), dryRun :Bool) -> (result :Reclaimed);
  inventory @5 () -> (inventory :Inventory);
  engineCheck @6 (engine :Text, argv :List(Text)) -> (check :FlagCheck);
  # The declaration changed (server.yaml reloaded): converge on it.
  declareEngines @7 (epoch :Int64, engines :EngineDecls) -> ();
  # What `logs` can read here: "agent", then SHARD/PROCESS/stdout|stderr per shard.
  logSources @8 () -> (sources :List(Text));
  # Stop the running shard spec.shardId (SIGTERM, SIGKILL after graceS) and start it
  # again from spec, which may differ from its current spec only in adapters and
  # adapterSources; the new sources are made ready first, while the old engine serves.
  relaunchShard @9 (epoch :Int64, spec :ShardSpec, graceS :Float64) -> (shard :ShardReport);
  # Make an adapter's source ready on the node (as a shard's source: single flight,
  # whole or nothing) and answer its local path.
  fetchAdapter @10 (epoch :Int64, source :Text, engine :Text) -> (path :Text);
}

interface LogSink {
  line @0 (line :LogLine) -> ();
  done @1 () -> ();
  alive @2 () -> ();           # a keepalive: the follower is there, nothing new
}
