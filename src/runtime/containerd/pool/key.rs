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

/// The digest image record `name` targets now (`None`: no such record).
async fn target_of(client: &crate::containerd::Containerd, name: &str) -> Result<Option<String>, RuntimeError> {
    Ok(client.image_get(name).await?.and_then(|i| i.target).map(|t| t.digest))
}

impl Engine {
    /// The key of the pool that can serve this plan, with its layout and the image it
    /// resolved (a cold start goes on with that, instead of resolving it again).
    pub async fn pool_key(&self, plan: &RunPlan) -> Result<(String, Layout, ImageInfo), RuntimeError> {
        // An Environment that snapshots its setup: members start from that snapshot (a claim
        // gets a sandbox warm and prepared), as its cold jobs do.
        let prepared = self.on_setup_snapshot(plan).await;
        let plan = prepared.as_ref().unwrap_or(plan);
        let image_name = plan
            .env()
            .image
            .clone()
            .ok_or_else(|| RuntimeError::Refused("spec.image is required".into()))?;
        let layout = member_layout(plan);
        let policy = plan.env().image_pull_policy;
        // `Always` pulls whatever is cached: the registry may have moved the tag.
        let cacheable = policy.unwrap_or_else(|| PullPolicy::default_for(&image_name)) != PullPolicy::Always;
        // The name `ensure` looks up first; the cache only serves images found under it.
        let record = crate::image::normalize_name(&image_name).ok().filter(|_| cacheable);
        let inputs = record.as_ref().map(|r| self.key_inputs(plan, &layout, r));
        let mut seen = None;
        if let (Some(record), Some(inputs)) = (&record, &inputs) {
            let cached = cache().lock().expect("pool key cache").get(inputs).cloned();
            seen = target_of(&self.client, record).await?;
            if let Some(c) = cached.filter(|c| Some(&c.target) == seen.as_ref() && &c.record == record) {
                return Ok((c.key, layout, c.image));
            }
            tracing::debug!(image = record, "pool key computed (not kept, or its image changed)");
        }
        let image = crate::image::remote::ensure(&self.client, &image_name, policy, &self.options.registry).await?;
        let key = self.compute_key(plan, &layout, &image)?;
        // Kept with the digest read *before* the image was resolved: should the record have
        // moved in between, the next claim finds another digest and computes the key again
        // (a miss, never a stale key).
        if let (Some(record), Some(inputs), Some(target)) = (record, inputs, seen)
            && image.name == record
        {
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
        Ok((key, layout, image))
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
        for tool in &self.options.tools {
            h.update(tool.name.as_bytes());
            h.update(Sha256::digest(tool.contents));
        }
        Ok(hex::encode(&h.finalize()[..12]))
    }
}

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
