//! `diphoma-kubelet`: the process kubelet as a program.
//!
//! - `diphoma-kubelet run --kubeconfig K --root DIR --socket S --nodes 4 --gpus 8` registers the
//!   nodes and runs their pods until SIGTERM/SIGINT, then kills every pod process it started;
//!   `--clock-offset-seconds -30` writes the nodes' Lease `renewTime`s 30 s behind this machine's
//!   clock (nodes whose clocks disagree with the control plane's).
//! - `diphoma-kubelet fail-node --socket S NODE [--mode kill|freeze]` asks a running kubelet to
//!   fail a node (heartbeats stop, processes killed or frozen, pods left Running in the API).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use diphoma_e2e::Error;
use diphoma_e2e::cluster::client_from_kubeconfig;
use diphoma_e2e::kubelet::node::NodeConfig;
use diphoma_e2e::kubelet::{FailMode, Kubelet, KubeletConfig, Runtime};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

#[derive(Parser)]
#[command(
    version,
    about = "Diphoma's process kubelet: GPU nodes whose pods run as local processes"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// The products `make cluster-up` labels its nodes with, in turn: two GPU generations, so that
/// `manifests/examples/mixed-gpus.yaml` places one job across both.
const DEFAULT_GPU_PRODUCTS: &str = "NVIDIA-H100-80GB-HBM3,NVIDIA-A100-SXM4-80GB";

#[derive(Subcommand)]
enum Cmd {
    /// Register nodes and run their pods until terminated.
    Run {
        /// Kubeconfig with node and pod write access (the admin one of `make cluster-up`).
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: PathBuf,
        /// Directory for pod directories and container logs.
        #[arg(long)]
        root: PathBuf,
        /// Control socket for `fail-node`.
        #[arg(long)]
        socket: PathBuf,
        /// Number of GPU nodes, named `gpu-node-0` … .
        #[arg(long, default_value_t = 4)]
        nodes: u32,
        /// `nvidia.com/gpu` per node.
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// `nvidia.com/gpu.product` labels, comma-separated, given to the nodes in turn (node
        /// `i` gets product `i mod n`): mixed hardware on one cluster.
        #[arg(long, value_delimiter = ',', default_value = DEFAULT_GPU_PRODUCTS)]
        gpu_products: Vec<String>,
        /// Directory of the workspace binaries the images map to (default: this program's own).
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// Extra image mappings, `NAME=PATH` (repeatable).
        #[arg(long = "image")]
        images: Vec<String>,
        /// `process` (images map to workspace binaries) or `podman` (containers of images in the
        /// local image store).
        #[arg(long, default_value = "process")]
        runtime: Runtime,
        /// Seconds the nodes' clocks are ahead of this machine's (negative: behind), as their
        /// Lease `renewTime`s show.
        #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
        clock_offset_seconds: i64,
    },
    /// Fail a node of a running kubelet.
    FailNode {
        /// The kubelet's control socket.
        #[arg(long)]
        socket: PathBuf,
        /// Node name.
        node: String,
        /// `kill` (SIGKILL its processes) or `freeze` (SIGSTOP them).
        #[arg(long, default_value = "freeze")]
        mode: String,
    },
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().cmd {
        Cmd::Run {
            kubeconfig,
            root,
            socket,
            nodes,
            gpus,
            gpu_products,
            bin_dir,
            images,
            runtime,
            clock_offset_seconds,
        } => {
            let node = |i: u32| NodeConfig {
                clock_offset_seconds,
                gpu_product: gpu_products[i as usize % gpu_products.len().max(1)].clone(),
                ..NodeConfig::gpu(&format!("gpu-node-{i}"), gpus)
            };
            let nodes = (0..nodes).map(node).collect();
            run(kubeconfig, root, socket, nodes, bin_dir, images, runtime).await
        }
        Cmd::FailNode { socket, node, mode } => fail_node(socket, node, mode).await,
    };
    if let Err(e) = result {
        eprintln!("diphoma-kubelet: {e}");
        std::process::exit(1);
    }
}

async fn run(
    kubeconfig: PathBuf,
    root: PathBuf,
    socket: PathBuf,
    nodes: Vec<NodeConfig>,
    bin_dir: Option<PathBuf>,
    images: Vec<String>,
    runtime: Runtime,
) -> Result<(), Error> {
    let bin_dir = match bin_dir {
        Some(d) => d,
        None => std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(PathBuf::from))
            .unwrap_or_default(),
    };
    let mut cfg = KubeletConfig::from_kubeconfig(&kubeconfig, nodes, &bin_dir, root)?;
    cfg.runtime = runtime;
    for spec in &images {
        cfg.images.insert_spec(spec)?;
    }
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|source| Error::Io {
        path: socket.clone(),
        source,
    })?;
    let kubelet = Kubelet::start(client_from_kubeconfig(&kubeconfig).await?, cfg).await?;
    tracing::info!(socket = %socket.display(), "process kubelet running");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|source| Error::Io {
            path: "SIGTERM handler".into(),
            source,
        })?;
    loop {
        tokio::select! {
            conn = listener.accept() => if let Ok((stream, _)) = conn { control(&kubelet, stream).await },
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    kubelet.shutdown().await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// One control request: `fail-node NODE MODE` → `ok` or `error: …`.
async fn control(kubelet: &Kubelet, stream: UnixStream) {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    if BufReader::new(r).read_line(&mut line).await.is_err() {
        return;
    }
    let reply = match line.split_whitespace().collect::<Vec<_>>()[..] {
        ["fail-node", node, mode] => mode
            .parse()
            .and_then(|m: FailMode| kubelet.fail_node(node, m)),
        _ => Err(Error::Config {
            field: "request".into(),
            message: format!("{:?} is not `fail-node NODE MODE`", line.trim()),
        }),
    };
    let text = match reply {
        Ok(()) => "ok\n".to_owned(),
        Err(e) => format!("error: {e}\n"),
    };
    let _ = w.write_all(text.as_bytes()).await;
}

async fn fail_node(socket: PathBuf, node: String, mode: String) -> Result<(), Error> {
    mode.parse::<FailMode>()?;
    let io = |source| Error::Io {
        path: socket.clone(),
        source,
    };
    let mut stream = UnixStream::connect(&socket).await.map_err(io)?;
    stream
        .write_all(format!("fail-node {node} {mode}\n").as_bytes())
        .await
        .map_err(io)?;
    let mut reply = String::new();
    BufReader::new(stream)
        .read_line(&mut reply)
        .await
        .map_err(io)?;
    match reply.trim().strip_prefix("error: ") {
        Some(msg) => Err(Error::Config {
            field: "fail-node".into(),
            message: msg.to_owned(),
        }),
        None => Ok(()),
    }
}
