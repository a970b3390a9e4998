//! A pool's key, and the cache that keeps it off a claim's path.
//!
//! The key hashes the member's spec (built from the plan and the host), the image's layers and
//! the tools shipped in. Building and hashing that spec, and resolving the image through
//! containerd, cost every claim 2-4.5 ms in a debug build and queued a burst's claims behind
//! one another; yet for one Environment and one image the answer is always the same. So it is
//! kept, per process, by everything it is computed from but the image's content (the member
//! plan, its layout, the host, the tools, the state dir and containerd), together with the
//! target digest the image record named when it was computed. A claim reuses it only while
//! the record still names that digest (one `Images.Get`): an image re-tagged, re-pulled or
//! re-imported under the name changes the target and the key is computed again. Content is
//! addressed by digest, so the same target is the same manifest, config and layers.

use std::sync::{Mutex, OnceLock};

use super::*;
use crate::manifest::PullPolicy;

/// The metric counting the keys `compute_for` computed (misses of the cache, or no cache).
pub const KEYS_COMPUTED: &str = "runner_pool_keys_computed_total";

/// The metric counting the image record reads that confirm kept keys, by whether the read
/// was sent ahead, when the request arrived (`ImageRead`).
pub const IMAGE_READS: &str = "runner_pool_image_reads_total";

/// Keys kept before the cache starts over (one per Environment shape and image in use).
const CACHED_KEYS: usize = 256;

#[derive(Clone)]
struct Cached {
    /// The image record's name the key was computed from, and the digest it named.
    record: String,
    target: String,
    key: String,
    image: ImageInfo,
}

fn cache() -> &'static Mutex<HashMap<String, Cached>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Cached>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// One turn per key's inputs for computing it: the claims that miss the cache together (a
/// burst on a server whose cache is still empty) wait for the first one's key instead of each
/// computing it. 256 claims at once each resolving the image and building and hashing the
/// spec took the burst's 2 cores for ~0.4 s before the first member was claimed. The turn
/// holds when its last computation ended leaving nothing kept (it failed, or its key could not
/// be kept): the claims that waited for that one then compute side by side, as they did
/// before the turns, instead of one after another (a pull timing out N times in a row).
type Turn = std::sync::Arc<tokio::sync::Mutex<Option<std::time::Instant>>>;

fn computing(inputs: &str) -> Turn {
    static TURNS: OnceLock<Mutex<HashMap<String, Turn>>> = OnceLock::new();
    let mut turns = TURNS.get_or_init(Default::default).lock().expect("pool key turns");
    // Bounded as the cache is: the turns nobody holds or waits for go (a held one stays).
    if turns.len() >= CACHED_KEYS && !turns.contains_key(inputs) {
        turns.retain(|_, t| std::sync::Arc::strong_count(t) > 1);
    }
    turns.entry(inputs.to_string()).or_default().clone()
}

/// The digest image record `name` targets now (`None`: no such record).
async fn target_of(client: &crate::containerd::Containerd, name: &str) -> Result<Option<String>, RuntimeError> {
    Ok(client.image_get(name).await?.and_then(|i| i.target).map(|t| t.digest))
}

/// An image record's target read ahead of a session's claim: sent when the create request
/// arrived, so that its round trip to containerd (~1 ms, which a claim otherwise waited for
/// after its own work) runs beside the request's manifest. It was sent after the request
/// arrived, so it sees every change to the record made before the request: what `confirm`
/// checks is as fresh as with a read sent at the claim. Taken once, by a claim whose kept key
/// names the same record; the image named is a hint (a wrong one costs a wasted read).
#[derive(Clone, Default)]
pub struct ImageRead(std::sync::Arc<Mutex<Option<(String, TargetRead)>>>);

type TargetRead = tokio::task::JoinHandle<Result<Option<String>, RuntimeError>>;

impl ImageRead {
    /// Start reading the record image `image` is found under (nothing when it cannot be
    /// named).
    pub fn start(client: &crate::containerd::Containerd, image: &str) -> Self {
        let Ok(record) = crate::image::normalize_name(image) else {
            return Self::default();
        };
        let read = {
            let (client, record) = (client.clone(), record.clone());
            tokio::spawn(async move { target_of(&client, &record).await })
        };
        ImageRead(std::sync::Arc::new(Mutex::new(Some((record, read)))))
    }

    /// Drop the read, taken or not: it is fresh only for the claim of the request that sent
    /// it (a later claim through the same options must read again).
    pub(super) fn forget(&self) {
        self.0.lock().expect("image read").take();
    }

    /// The read, when it was of `record` and nobody took it yet.
    fn take_for(&self, record: &str) -> Option<TargetRead> {
        let mut slot = self.0.lock().expect("image read");
        match slot.take() {
            Some((r, read)) if r == record => Some(read),
            other => {
                *slot = other;
                None
            }
        }
    }
}

impl std::fmt::Debug for ImageRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ImageRead")
    }
}

/// A key taken from the cache, not yet checked against the image record: the record's
/// target is being read beside the claim (one `Images.Get`, sent when the claim began or,
/// for a session, when its request arrived: `ImageRead`), and
/// nothing taken from the cache leaves the claim before `confirm` says it still holds.
pub(super) struct KeyCheck {
    read: TargetRead,
    inputs: String,
    target: String,
}

impl KeyCheck {
    /// Whether the image record still names the content the key was computed for; when it
    /// does not, the key is dropped from the cache (the next computation replaces it).
    pub(super) async fn confirm(self) -> Result<bool, RuntimeError> {
        let now = self
            .read
            .await
            .map_err(|e| RuntimeError::Internal(format!("reading the image record: {e}")))??;
        if now.as_ref() == Some(&self.target) {
            return Ok(true);
        }
        let mut cache = cache().lock().expect("pool key cache");
        if cache.get(&self.inputs).is_some_and(|c| c.target == self.target) {
            cache.remove(&self.inputs);
        }
        tracing::debug!(key = self.inputs, "the image changed under a kept pool key");
        Ok(false)
    }
}

impl Engine {
    /// The key of the pool that can serve this plan, with its layout and the image it
    /// resolved (a cold start goes on with that, instead of resolving it again).
    pub async fn pool_key(&self, plan: &RunPlan) -> Result<(String, Layout, ImageInfo), RuntimeError> {
        let (key, layout, image, check) = self.pool_key_unchecked(plan).await?;
        if let Some(check) = check
            && !check.confirm().await?
        {
            let (key, layout, image, _) = self.pool_key_computed(plan).await?;
            return Ok((key, layout, image));
        }
        Ok((key, layout, image))
    }

    /// `pool_key`, from the cache when it has the key (then with the check to `confirm` before
    /// anything of it is used), else computed.
    pub(super) async fn pool_key_unchecked(
        &self,
        plan: &RunPlan,
    ) -> Result<(String, Layout, ImageInfo, Option<KeyCheck>), RuntimeError> {
        let (plan, layout, record, inputs) = match self.key_plan(plan).await? {
            (plan, layout, Some((record, inputs))) => (plan, layout, record, inputs),
            (plan, _, None) => return self.compute_for(&plan, None).await,
        };
        if let Some(kept) = self.kept_key(&record, &inputs, &layout) {
            return Ok(kept);
        }
        let waited_from = std::time::Instant::now();
        let turn = computing(&inputs);
        let mut left_nothing = turn.lock().await;
        // Computed by the claim whose turn this one waited for.
        if let Some(kept) = self.kept_key(&record, &inputs, &layout) {
            return Ok(kept);
        }
        if left_nothing.is_some_and(|ended| ended >= waited_from) {
            drop(left_nothing);
            return self.compute_for(&plan, Some((record, inputs))).await;
        }
        let computed = self.compute_for(&plan, Some((record.clone(), inputs.clone()))).await;
        let kept = cache()
            .lock()
            .expect("pool key cache")
            .get(&inputs)
            .is_some_and(|c| c.record == record);
        *left_nothing = (!kept).then(std::time::Instant::now);
        computed
    }

    /// The cache's key for `inputs` when it was computed from image record `record`, with
    /// the check (its record's target, read from now on) that must confirm it.
    fn kept_key(
        &self,
        record: &str,
        inputs: &str,
        layout: &Layout,
    ) -> Option<(String, Layout, ImageInfo, Option<KeyCheck>)> {
        let c = cache()
            .lock()
            .expect("pool key cache")
            .get(inputs)
            .filter(|c| c.record == record)
            .cloned()?;
        let ahead = self.options.image_read.as_ref().and_then(|r| r.take_for(record));
        let label = if ahead.is_some() { "true" } else { "false" };
        crate::metrics::increment(IMAGE_READS, &[("ahead", label)]);
        let read = ahead.unwrap_or_else(|| {
            let (client, record) = (self.client.clone(), record.to_string());
            tokio::spawn(async move { target_of(&client, &record).await })
        });
        let check = KeyCheck {
            read,
            inputs: inputs.to_string(),
            target: c.target,
        };
        Some((c.key, layout.clone(), c.image, Some(check)))
    }

    /// `pool_key`, computed (and kept).
    pub(super) async fn pool_key_computed(
        &self,
        plan: &RunPlan,
    ) -> Result<(String, Layout, ImageInfo, Option<KeyCheck>), RuntimeError> {
        let (plan, _, keep) = self.key_plan(plan).await?;
        self.compute_for(&plan, keep).await
    }

    /// The plan a key is computed from (on its setup snapshot, when its Environment makes
    /// one), its layout and, when its key may be kept, the image record's name and the
    /// cache's entry for it.
    async fn key_plan(&self, plan: &RunPlan) -> Result<(RunPlan, Layout, Option<(String, String)>), RuntimeError> {
        // An Environment that snapshots its setup: members start from that snapshot (a claim
        // gets a sandbox warm and prepared), as its cold jobs do.
        let plan = self.on_setup_snapshot(plan).await.unwrap_or_else(|| plan.clone());
        let image_name = plan
            .env()
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        let layout = member_layout(&plan);
        // `Always` pulls whatever is cached: the registry may have moved the tag.
        let cacheable = plan.env().pull_policy() != PullPolicy::Always;
        // The name `ensure` looks up first; the cache only serves images found under it.
        let keep = crate::image::normalize_name(&image_name)
            .ok()
            .filter(|_| cacheable)
            .map(|record| {
                let inputs = self.key_inputs(&plan, &layout, &record);
                (record, inputs)
            });
        Ok((plan, layout, keep))
    }

    /// The key computed: the image resolved, the member's spec built and hashed; kept when
    /// `keep` names the record and cache entry.
    async fn compute_for(
        &self,
        plan: &RunPlan,
        keep: Option<(String, String)>,
    ) -> Result<(String, Layout, ImageInfo, Option<KeyCheck>), RuntimeError> {
        let layout = member_layout(plan);
        let image_name = plan
            .env()
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        // Read *before* the image is resolved: should the record move in between, the next
        // claim's check finds another digest and the key is computed again (a miss, never a
        // stale key).
        let seen = match &keep {
            Some((record, _)) => target_of(&self.client, record).await?,
            None => None,
        };
        let image = crate::image::remote::ensure(
            &self.client,
            &image_name,
            plan.env().image_pull_policy,
            &self.options.registry,
        )
        .await?;
        let key = self.compute_key(plan, &layout, &image)?;
        crate::metrics::increment(KEYS_COMPUTED, &[]);
        if let (Some((record, inputs)), Some(target)) = (keep, seen)
            && image.name == record
        {
            tracing::debug!(image = record, "pool key computed and kept");
            let mut cache = cache().lock().expect("pool key cache");
            if cache.len() >= CACHED_KEYS {
                cache.clear();
            }
            cache.insert(
                inputs,
                Cached {
                    record,
                    target,
                    key: key.clone(),
                    image: image.clone(),
                },
            );
        }
        Ok((key, layout, image, None))
    }

    /// Everything a pool key is computed from but the image's content (see `inputs`), for
    /// this engine: its host, tools (static data: their address names their content), state
    /// dir and containerd.
    fn key_inputs(&self, plan: &RunPlan, layout: &Layout, record: &str) -> String {
        let tools: Vec<(&str, usize, usize)> = self
            .options
            .tools
            .iter()
            .map(|t| (t.name, t.contents.as_ptr() as usize, t.contents.len()))
            .collect();
        let engine = format!(
            "{:?}\n{tools:?}\n{}\n{:?}",
            self.host,
            self.run_dir.display(),
            self.client
        );
        inputs(plan, layout, record, &engine)
    }

    /// The key itself: a hash of the member's spec, the image's top layer chain, the layout,
    /// the agent, the shell's launcher and the tools.
    fn compute_key(&self, plan: &RunPlan, layout: &Layout, image: &ImageInfo) -> Result<String, RuntimeError> {
        let mut member = member_plan(plan);
        member.image_env = image.config.env.clone().unwrap_or_default();
        let spec = member_spec(&member, &self.host, layout, Path::new("/late"))?;
        let json = spec::to_json(&spec).map_err(|e| RuntimeError::Internal(format!("encoding the spec: {e}")))?;
        let mut h = Sha256::new();
        h.update(json.to_string().as_bytes());
        h.update(image.top_chain.as_bytes());
        h.update(serde_json::to_vec(layout).unwrap_or_default());
        h.update(agent::AGENT_SCRIPT.as_bytes());
        h.update(super::super::prelaunch::LAUNCH.as_bytes());
        h.update(MEMBER_FORMAT.as_bytes());
        for tool in &self.options.tools {
            h.update(tool.name.as_bytes());
            h.update(Sha256::digest(tool.contents));
        }
        Ok(hex::encode(&h.finalize()[..12]))
    }
}

/// What a member is made like beyond its spec, which a runner claiming it must know: a runner
/// that does not (an older one on the same state dir) computes other keys, and never claims it.
/// The filler takes the static root out (`hide::take_static_out`).
const MEMBER_FORMAT: &str = "static root taken out by the filler";

/// A digest of what a pool key depends on besides the image's content and the engine
/// (`engine`): the plan a member is made from, its layout and the image's name. Debug output
/// shows every field, so a field added later is in it (a miss at worst, never a stale key).
/// Left out: what each job or session has of its own and no member's spec reads — its name
/// (`bend` gives members a hostname of their own), labels, annotations, where its file and
/// fields were, its workspace and assets (bound late; the layout says where) and its mounts
/// as written (the plan's `job_mounts`, resolved, stay in).
pub(super) fn inputs(plan: &RunPlan, layout: &Layout, record: &str, engine: &str) -> String {
    let mut member = member_plan(plan);
    let job = &mut member.bound.job;
    job.name.clear();
    job.labels.clear();
    job.annotations.clear();
    job.environment_origin.location = None;
    job.workspace = None;
    job.workspace_origin = None;
    job.static_assets.clear();
    job.mounts.clear();
    job.base_dir = PathBuf::new();
    job.file = None;
    let text = format!("{record}\n{member:?}\n{layout:?}\n{engine}");
    hex::encode(Sha256::digest(text.as_bytes()))
}
