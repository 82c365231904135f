//! Ring changes inside one process: survivors keep their model, roll back to the last committed
//! step, re-form the ring at the next generation; a joiner receives the state by broadcast; the
//! result equals an undisturbed run.

mod common;

use std::collections::VecDeque;
use std::path::Path;

use common::max_diff;
use diphoma_ring::CommError;
use diphoma_ring::source::{Control, Generation, Progress, RingSource, local_generation};
use diphoma_worker::data;
use diphoma_worker::optim::{OptState, OptimizerKind};
use diphoma_worker::train::{TrainConfig, train_rank, train_standalone};

/// As in `tests/train.rs`: the runs differ only in the order of f32 additions (world 4, 3, 4
/// against 4), measured gap ~1e-7 after 40 steps.
const TOL: f32 = 1e-5;

/// A scripted membership source for one rank: what to do after given committed steps, and the
/// generations handed out after failures, in order.
#[derive(Default)]
struct Script {
    after_step: Vec<(u64, Control)>,
    on_failure: VecDeque<Generation>,
    failures: Vec<String>,
}

impl RingSource for Script {
    fn after_commit(&mut self, p: &Progress) -> Control {
        match self.after_step.iter().position(|(s, _)| *s == p.step) {
            Some(i) => self.after_step.remove(i).1,
            None => Control::Continue,
        }
    }
    fn after_failure(&mut self, err: &CommError) -> Option<Generation> {
        self.failures.push(err.metric_label().to_string());
        self.on_failure.pop_front()
    }
}

#[test]
fn survivors_reform_and_a_joiner_catches_up() {
    survivors_reform_and_a_joiner_catches_up_with(TrainConfig {
        steps: 40,
        ..TrainConfig::default()
    });
}

/// The same with AdamW, whose moments and step count the joiner must receive with the
/// parameters (without them its updates, and so everyone's parameters, would differ).
#[test]
fn survivors_reform_and_a_joiner_catches_up_with_adamw() {
    survivors_reform_and_a_joiner_catches_up_with(TrainConfig {
        steps: 40,
        optimizer: OptimizerKind::AdamW,
        lr: 0.01,
        ..TrainConfig::default()
    });
}

fn survivors_reform_and_a_joiner_catches_up_with(cfg: TrainConfig) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz");
    let train = data::load_digits(&path).unwrap().split().0;
    let key = [42u8; 32];
    // Generation 1: four ranks. Rank 3 dies after step 10 (drops its sockets: the others' next
    // allreduce fails). Generation 2: the three survivors. After step 25 the operator adds a
    // member: generation 3 of four, the joiner being rank 3.
    let g1 = local_generation(4, 1, &key).unwrap();
    let mut g2: VecDeque<_> = local_generation(3, 2, &key).unwrap().into();
    let mut g3: VecDeque<_> = local_generation(4, 3, &key).unwrap().into();
    let mut scripts: Vec<Script> = Vec::new();
    let mut firsts = Vec::new();
    for (r, g) in g1.into_iter().enumerate() {
        let mut s = Script::default();
        if r == 3 {
            s.after_step.push((10, Control::Leave));
        } else {
            s.on_failure.push_back(g2.pop_front().unwrap());
            s.after_step
                .push((25, Control::Switch(g3.pop_front().unwrap())));
        }
        scripts.push(s);
        firsts.push(g);
    }
    firsts.push(g3.pop_front().unwrap());
    scripts.push(Script::default());
    let outs: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = firsts
            .into_iter()
            .zip(scripts)
            .map(|(g, mut s)| {
                let (cfg, train) = (&cfg, &train);
                sc.spawn(move || {
                    let o = train_rank(cfg, train, g, &mut s).unwrap();
                    (o, s.failures)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let reference = train_standalone(&cfg, &train, 4).unwrap();
    let p_ref = reference[0].model.flat_params().unwrap();
    // The victim left at step 10.
    assert!(outs[3].0.left);
    assert_eq!(outs[3].0.step, 10);
    // Survivors: one failure each (the lost peer), generations 1, 2, 3, every step committed.
    for (o, failures) in &outs[..3] {
        assert_eq!(o.generations, vec![1, 2, 3]);
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(o.step, 40);
        let d = max_diff(&o.losses, &reference[0].losses);
        assert!(d <= TOL, "loss curve differs by {d}");
    }
    // The joiner trained only in generation 3 and got the state by broadcast.
    let (joiner, failures) = &outs[4];
    assert_eq!(joiner.generations, vec![3]);
    assert!(failures.is_empty());
    assert!(joiner.losses[..25].iter().all(|l| l.is_nan()));
    // Everyone ends with the undisturbed run's parameters, and the same as each other.
    for (r, (o, _)) in outs.iter().enumerate().filter(|(r, _)| *r != 3) {
        let p = o.model.flat_params().unwrap();
        let d = max_diff(&p, &p_ref);
        assert!(d <= TOL, "member {r}: {d} from the undisturbed run");
        assert_eq!(p, outs[0].0.model.flat_params().unwrap());
        // The optimizer's state too: bit-identical on every member (the joiner's came by
        // broadcast), and the undisturbed run's within the tolerance.
        let st = o.optimizer.state().unwrap();
        assert_eq!(st, outs[0].0.optimizer.state().unwrap(), "member {r}");
        let st_ref = reference[0].optimizer.state().unwrap();
        if let (
            OptState::AdamW { step, m, v },
            OptState::AdamW {
                step: s0,
                m: m0,
                v: v0,
            },
        ) = (&st, &st_ref)
        {
            assert_eq!(step, s0);
            assert_eq!(*step, 40);
            let (dm, dv) = (max_diff(m, m0), max_diff(v, v0));
            assert!(dm <= TOL && dv <= TOL, "member {r}: moments {dm} {dv} away");
        } else {
            assert_eq!(st, st_ref);
        }
    }
    eprintln!(
        "{}: max parameter gap disturbed vs undisturbed: {:e}",
        cfg.optimizer.name(),
        max_diff(&outs[0].0.model.flat_params().unwrap(), &p_ref)
    );
}

#[test]
fn a_generation_adopts_the_most_advanced_members_state() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz");
    let train = data::load_digits(&path).unwrap().split().0;
    let base = std::env::temp_dir().join(format!("diphoma-elastic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (ahead, fresh) = (base.join("ahead"), base.join("fresh"));
    // A checkpoint at step 20 that only rank 1 sees; rank 0 starts from scratch.
    let first = TrainConfig {
        steps: 20,
        checkpoint_every: 20,
        checkpoint_dir: Some(ahead.clone()),
        ..TrainConfig::default()
    };
    train_standalone(&first, &train, 1).unwrap();
    let cfg = |dir: &Path| TrainConfig {
        steps: 40,
        checkpoint_dir: Some(dir.to_path_buf()),
        ..TrainConfig::default()
    };
    let (c0, c1) = (cfg(&fresh), cfg(&ahead));
    let gens = local_generation(2, 1, &[1u8; 32]).unwrap();
    let outs: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = gens
            .into_iter()
            .zip([&c0, &c1])
            .map(|(g, c)| {
                let train = &train;
                sc.spawn(move || train_rank(c, train, g, &mut Script::default()).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let reference = train_standalone(
        &TrainConfig {
            steps: 40,
            ..TrainConfig::default()
        },
        &train,
        2,
    )
    .unwrap();
    let p_ref = reference[0].model.flat_params().unwrap();
    for o in &outs {
        // Both trained steps 21..40 only: rank 0 received rank 1's step-20 state.
        assert!(o.losses[..20].iter().all(|l| l.is_nan()));
        let d = max_diff(&o.model.flat_params().unwrap(), &p_ref);
        assert!(d <= TOL, "{d} from the uninterrupted run");
    }
    let _ = std::fs::remove_dir_all(base);
}
