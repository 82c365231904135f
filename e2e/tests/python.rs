//! PyTorch jobs on the local control plane: `manifests/examples/pytorch-digits.yaml` (a DDP
//! script in a ConfigMap, the image `diphoma-pytorch`, which this binary's process kubelet runs
//! as the python of the cached torch venv with the freshly built `diphoma` wheel,
//! `python/install.sh`) through a kill -9 of a worker, under the operator installed by its chart.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use common::*;
use diphoma_e2e::kit::{pid_of, signal};
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_operator::api::{DiphomaJobStatus, Phase};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;

fn main() -> Result<()> {
    let venv =
        run_ok(std::process::Command::new("bash").arg(repo_root().join("python/install.sh")))
            .context("the torch venv with the diphoma wheel (python/install.sh)")?;
    let python = PathBuf::from(venv.trim()).join("bin/python");
    EXTRA_IMAGES
        .set(vec![("diphoma-pytorch".to_owned(), python)])
        .expect("set once");
    let nodes = (0..2)
        .map(|i| NodeConfig::gpu(&format!("gpu-{i}"), 4))
        .collect();
    run_tests(
        nodes,
        OperatorMode::Chart,
        tests![the_pytorch_digits_example_survives_a_killed_worker],
    )
}

/// The example as shipped, but `steps` steps (the manifest's `STEPS` value replaced).
fn example(steps: u64) -> Result<String> {
    let path = repo_root().join("manifests/examples/pytorch-digits.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let from = "- name: STEPS\n              value: \"600\"";
    ensure!(
        text.contains(from),
        "{} has no STEPS of 600",
        path.display()
    );
    Ok(text.replace(
        from,
        &format!("- name: STEPS\n              value: \"{steps}\""),
    ))
}

async fn the_pytorch_digits_example_survives_a_killed_worker(
    ctx: Arc<Ctx>,
    ns: String,
) -> Result<()> {
    const STEPS: u64 = 300;
    let file = std::env::temp_dir().join(format!("pytorch-digits-{ns}.yaml"));
    std::fs::write(&file, example(STEPS)?)?;
    let applied = run_ok(ctx.cp.kubectl().args(["-n", &ns, "apply", "-f"]).arg(&file));
    std::fs::remove_file(&file)?;
    applied?;
    let status = async || -> Result<DiphomaJobStatus> {
        Ok(job_status(&ctx.client, &ns, "pytorch-digits")
            .await?
            .status
            .unwrap_or_default())
    };
    // Training: rank 0's progress record reached the status.
    eventually(240, "progress in the status", async || {
        Ok(status().await?.progress.is_some_and(|p| p.step > 0))
    })
    .await?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let pid = |name: &'static str| {
        let pods = pods.clone();
        async move { Ok::<_, anyhow::Error>(pid_of(&pods.get(name).await?)?) }
    };
    let survivors = [
        "pytorch-digits-worker-0",
        "pytorch-digits-worker-2",
        "pytorch-digits-worker-3",
    ];
    let mut before = vec![];
    for name in survivors {
        before.push(pid(name).await?);
    }
    signal(pid("pytorch-digits-worker-1").await?, libc::SIGKILL);
    let mut last = None;
    eventually(600, "the job Succeeded", async || {
        let st = status().await?;
        let done = st.phase.is_some_and(Phase::is_terminal);
        last = Some(st);
        Ok(done)
    })
    .await
    .with_context(|| format!("last status {last:?}"))?;
    let st = last.context("no status")?;
    ensure!(st.phase == Some(Phase::Succeeded), "{st:?}");
    ensure!(st.repairs.total == 1, "repairs {:?}", st.repairs);
    for (name, pid) in survivors.iter().zip(before) {
        let p = pods.get(name).await?;
        let restarts = first_container(&p).map_or(-1, |c| c.restart_count);
        ensure!(
            terminated(&p).map(|t| t.0) == Some(0) && restarts == 0,
            "{name} (pid {pid}) did not keep its process: {:?}, {restarts} restarts",
            terminated(&p)
        );
    }
    let progress = st.progress.context("no progress")?;
    let accuracy = progress.test_accuracy.context("no test accuracy")?;
    ensure!(
        progress.step == i64::try_from(STEPS)? && accuracy >= 0.95,
        "step {} of {STEPS}, test accuracy {accuracy}",
        progress.step
    );
    Ok(())
}
