//! `cuvmm bench sleep --processes N`: one process per device, all sleeping at once.
//!
//! Each child runs `bench sleep --json` on its device and stops at a barrier before each cycle
//! and before the fresh-memory floor; this process lets them all go once every child still
//! running has reached it. So the children's sleeps, wakes and pinned bounds run together, and
//! each child's bound is a copy of its bytes made while the others copy theirs: what a sleep of
//! every GPU at once is judged against. A child that fails stops counting at the barriers, and
//! fails the run after the others' reports.

use super::sleep_args::{child_command, Args};
use crate::common::CliResult;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::mpsc::channel;

/// What one child said: a line of its output, or its end.
enum Said {
    Line(String),
    Ended,
}

/// Runs a child per device of `devices`, each cycle started together, and reports each child's
/// summaries.
pub(super) fn cli(args: &Args, devices: &[usize], out: &mut impl Write) -> CliResult {
    let mut cmds = Vec::new();
    for &dev in devices {
        let mut cmd = child_command(args, &[dev])?;
        cmd.arg("--barrier");
        cmds.push(cmd);
    }
    let (lines, ok) = coordinate(cmds)?;
    report(out, args, devices, &lines)?;
    let failed: Vec<usize> = (0..devices.len()).filter(|&k| !ok[k]).map(|k| devices[k]).collect();
    if !failed.is_empty() {
        return Err(super::invalid(format!("the processes of devices {failed:?} failed")).into());
    }
    Ok(())
}

/// Starts `cmds` at once and lets them through each barrier together (once every child still
/// running is at it); each child's JSON lines other than its barriers, and whether it succeeded.
fn coordinate(cmds: Vec<std::process::Command>) -> std::io::Result<(Vec<Vec<Value>>, Vec<bool>)> {
    let (tx, rx) = channel::<(usize, Said)>();
    let mut children = Vec::new();
    let mut stdins = Vec::new();
    for (k, mut cmd) in cmds.into_iter().enumerate() {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd.spawn()?;
        stdins.push(child.stdin.take());
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                let _ = tx.send((k, Said::Line(line)));
            }
            let _ = tx.send((k, Said::Ended));
        });
        children.push(child);
    }
    drop(tx);
    let n = children.len();
    let (mut waiting, mut ended) = (vec![false; n], vec![false; n]);
    let mut lines: Vec<Vec<Value>> = vec![Vec::new(); n];
    while let Ok((k, said)) = rx.recv() {
        match said {
            Said::Ended => {
                ended[k] = true;
                stdins[k] = None;
            }
            Said::Line(l) => match serde_json::from_str::<Value>(&l) {
                Ok(v) if v["bench"] == "sleep-barrier" => waiting[k] = true,
                Ok(v) => lines[k].push(v),
                Err(_) => {}
            },
        }
        if waiting.iter().any(|&w| w) && (0..n).all(|i| waiting[i] || ended[i]) {
            for (w, stdin) in waiting.iter_mut().zip(stdins.iter_mut()) {
                if std::mem::take(w) {
                    if let Some(s) = stdin.as_mut() {
                        let _ = s.write_all(b"go\n").and_then(|()| s.flush());
                    }
                }
            }
        }
    }
    let ok =
        children.into_iter().map(|mut c| c.wait().map(|s| s.success())).collect::<std::io::Result<_>>()?;
    Ok((lines, ok))
}

/// Each child's summaries: JSON lines tagged with the process, or a table row per summary.
fn report(out: &mut impl Write, args: &Args, devices: &[usize], lines: &[Vec<Value>]) -> std::io::Result<()> {
    if args.json {
        for (k, ls) in lines.iter().enumerate() {
            for l in ls {
                writeln!(out, "{}", json!({"process": k, "device": devices[k], "line": l}))?;
            }
        }
        return Ok(());
    }
    writeln!(
        out,
        "{} processes, one per device ({devices:?}), each sleeping its own tag at once, every cycle started together; bounds are each process's pinned copies made while all copy",
        devices.len()
    )?;
    writeln!(out, "| process | device | run | first sleep ms (x D2H) | later sleeps x D2H (median) | D2H bound ms (median) | wake x H2D after frees (median) | fresh floor ms (x D2H) | first over floor | mismatches |")?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|")?;
    for (k, ls) in lines.iter().enumerate() {
        for s in ls.iter().filter(|v| v["bench"] == "sleep") {
            let f = |key: &str| s[key].as_f64();
            let x = |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
            writeln!(
                out,
                "| {k} | {} | {} | {} ({}) | {} | {} | {} | {} ({}) | {} | {} |",
                devices[k],
                s["run"].as_str().unwrap_or("-"),
                x(f("first_offload_ms"), 1),
                x(f("first_offload_ratio"), 3),
                x(f("offload_ratio"), 3),
                x(f("d2h_bound_ms"), 1),
                x(f("wake_ratio_after_frees"), 3),
                x(f("fresh_host_ms"), 1),
                x(f("fresh_host_ratio"), 3),
                x(f("first_over_floor"), 3),
                s["mismatches"],
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::sleep_args::parse_args;
    use super::*;

    /// A child as `sh` runs it: its steps, each a JSON line printed or a barrier waited at.
    fn child(script: &str) -> std::process::Command {
        let mut c = std::process::Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn children_pass_each_barrier_together_and_one_that_fails_holds_no_one_up() {
        // Each step prints the time it ran at (ns); the second child dawdles before its second
        // barrier, the third fails before it.
        let b = r#"echo '{"bench":"sleep-barrier"}'; read go"#;
        let step = |k: u32, i: u32| {
            format!(r#"echo "{{\"bench\":\"step\",\"child\":{k},\"step\":{i},\"ns\":$(date +%s%N)}}""#)
        };
        let script = |k: u32, pause: &str| format!("{b}; sleep {pause}; {}; {b}; {}", step(k, 1), step(k, 2));
        let cmds = vec![
            child(&script(0, "0")),
            child(&script(1, "0.3")),
            child(&format!("{b}; {}; exit 3", step(2, 1))),
        ];
        let (lines, ok) = coordinate(cmds).unwrap();
        assert_eq!(ok, [true, true, false]);
        assert_eq!(lines.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 1], "{lines:?}");
        assert!(lines.iter().flatten().all(|v| v["bench"] == "step"), "barriers are not passed on");
        let ns = |k: usize, i: usize| lines[k][i]["ns"].as_u64().expect("a time");
        assert!(
            ns(0, 1) >= ns(1, 0),
            "the first child passed its second barrier before the second reached it"
        );
    }

    #[test]
    fn a_child_takes_the_host_copies_of_its_parent() {
        for (argv, want) in [
            (&["bench"][..], None),
            (&["bench", "--host-copy", "plain"][..], Some("plain")),
            (&["bench", "--host-copy", "both"][..], Some("both")),
        ] {
            let cmd = child_command(&parse_args(argv), &[0]).unwrap();
            let got: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
            let at = got.iter().position(|a| a == "--host-copy");
            assert_eq!(at.map(|i| got[i + 1].as_str()), want, "{argv:?}: {got:?}");
        }
    }

    #[test]
    fn each_process_reports_a_row_per_run_and_its_barriers_are_not_rows() {
        let args = parse_args(&["bench"]);
        let summary = |run: &str, first: f64| {
            json!({"bench": "sleep", "run": run, "first_offload_ms": first, "first_offload_ratio": first / 330.0,
                "offload_ratio": 1.04, "d2h_bound_ms": 330.0, "wake_ratio_after_frees": 1.02,
                "fresh_host_ms": 360.5, "fresh_host_ratio": 1.09, "first_over_floor": first / 360.5, "mismatches": 0})
        };
        let cycle = json!({"bench": "sleep-cycle", "cycle": {}});
        let lines = vec![
            vec![
                cycle.clone(),
                summary("pageable, released lazily at wake", 400.0),
                summary("pageable, retained", 390.0),
            ],
            vec![cycle, summary("pageable, released lazily at wake", 420.0)],
        ];
        let mut out = Vec::new();
        report(&mut out, &args, &[2, 3], &lines).unwrap();
        let text = String::from_utf8(out).unwrap();
        let rows: Vec<&str> =
            text.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| process")).collect();
        assert_eq!(rows.len(), 3, "{text}");
        assert!(
            rows[0].starts_with("| 0 | 2 | pageable, released lazily at wake | 400.0 (1.212) | 1.040 |"),
            "{text}"
        );
        assert!(
            rows[2].starts_with("| 1 | 3 |") && rows[2].contains("| 360.5 (1.090) | 1.165 | 0 |"),
            "{text}"
        );
    }
}
