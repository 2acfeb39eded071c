//! Experiment 6: MapReduce word count, the counts reduced through each
//! aggregator.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use serde::Serialize;

use crate::agg::{Harness, Mode};
use crate::{progress, summarize, thousands, BenchOptions, Context_, Csv, Section, Summary};

use super::{compare, rng, VecWorkload};

#[derive(Debug, Clone, Serialize)]
pub(super) struct WcPoint {
    pub(super) mode: String,
    pub(super) group: String,
    pub(super) mappers: usize,
    pub(super) words: u64,
    pub(super) words_per_s: Summary,
    pub(super) map_secs: f64,
    pub(super) agg_secs: Summary,
}

/// TCP port of the records baseline's reducer on the aggregator host.
pub(super) const RECORDS_PORT: u16 = 7690;

/// The paper-style baseline of experiment 6: MapReduce without a combiner.
/// Every mapper streams one `(word, 1)` record (8 bytes) per word it read
/// over TCP to a user-space reducer on the aggregator host, which counts
/// them in a hash map (one reader thread per mapper, maps merged at the
/// end). Returns the shuffle + reduce time and the counts per word.
pub(super) fn records_reduce(h: &Harness, words: &[Vec<u32>]) -> Result<(f64, std::collections::HashMap<u32, u64>)> {
    use std::collections::HashMap;
    use std::io::{BufWriter, Read, Write};
    use std::net::{SocketAddrV4, TcpListener, TcpStream};

    let agg = h.tb.host(0);
    let at = SocketAddrV4::new(agg.addr, RECORDS_PORT);
    let listener = crate::testbed::in_netns(&agg.netns, || TcpListener::bind(at))??;
    let mut mappers = Vec::new();
    for r in 0..words.len() {
        let host = h.tb.host(r + 1);
        mappers.push(crate::testbed::in_netns(&host.netns, || TcpStream::connect(at))??);
    }
    let mut reducers = Vec::new();
    for _ in 0..words.len() {
        reducers.push(listener.accept()?.0);
    }
    let t = Instant::now();
    let maps: Vec<HashMap<u32, u64>> = std::thread::scope(|s| -> Result<Vec<HashMap<u32, u64>>> {
        for (stream, list) in mappers.into_iter().zip(words) {
            s.spawn(move || -> std::io::Result<()> {
                let mut out = BufWriter::with_capacity(64 << 10, stream);
                for &w in list {
                    out.write_all(&w.to_be_bytes())?;
                    out.write_all(&1u32.to_be_bytes())?;
                }
                out.flush()
            });
        }
        let readers: Vec<_> = reducers
            .into_iter()
            .map(|mut stream| {
                s.spawn(move || -> std::io::Result<HashMap<u32, u64>> {
                    let mut counts: HashMap<u32, u64> = HashMap::new();
                    let mut buf = vec![0u8; 64 << 10];
                    let mut have = 0usize;
                    loop {
                        let n = stream.read(&mut buf[have..])?;
                        if n == 0 {
                            break;
                        }
                        have += n;
                        let whole = have / 8 * 8;
                        for rec in buf[..whole].chunks_exact(8) {
                            let word = u32::from_be_bytes([rec[0], rec[1], rec[2], rec[3]]);
                            let count = u32::from_be_bytes([rec[4], rec[5], rec[6], rec[7]]);
                            *counts.entry(word).or_default() += u64::from(count);
                        }
                        buf.copy_within(whole..have, 0);
                        have -= whole;
                    }
                    Ok(counts)
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|r| r.join().map_err(|_| anyhow!("records reducer thread panicked"))?.map_err(Into::into))
            .collect()
    })?;
    let mut total: HashMap<u32, u64> = HashMap::new();
    for m in maps {
        for (w, c) in m {
            *total.entry(w).or_default() += c;
        }
    }
    Ok((t.elapsed().as_secs_f64(), total))
}

/// Word `i` of a Zipf(1) draw: the rank whose CDF bucket holds `u`.
pub(super) fn zipf_word(cdf: &[f64], u: f64) -> u32 {
    cdf.partition_point(|&x| x < u).min(cdf.len() - 1) as u32
}

/// Experiment 6.
pub fn run_wordcount(opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    let mappers: Vec<usize> = if opts.quick {
        vec![2]
    } else {
        vec![2, 4, 6, 8, 10]
    };
    let words_list: Vec<u64> = if opts.quick {
        vec![200_000]
    } else {
        vec![2_000_000, 4_000_000, 10_000_000]
    };
    let reps = opts.reps();
    let vocab = 1usize << 16;
    // Zipf(s = 1) over the vocabulary.
    let mut cdf = Vec::with_capacity(vocab);
    let mut acc = 0f64;
    for r in 1..=vocab {
        acc += 1.0 / r as f64;
        cdf.push(acc);
    }
    let mut points = Vec::new();
    let mut csv = Csv::new(&[
        "mode",
        "mappers",
        "words",
        "rep",
        "map_secs",
        "agg_secs",
        "words_per_s",
    ]);
    let mut round = 1u32;
    for &m in &mappers {
        let h = Harness::new(m)?;
        for &words in &words_list {
            // Map: each mapper draws its words and counts them into a vector
            // indexed by hash(word) (mappers run in parallel threads).
            let t = Instant::now();
            let counts: Vec<Vec<i32>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..m)
                    .map(|i| {
                        let cdf = &cdf;
                        s.spawn(move || {
                            let mut seed = 0x1234_5678u64 + i as u64 * 7919;
                            let mut c = vec![0i32; vocab];
                            let n = words / m as u64 + u64::from((i as u64) < words % m as u64);
                            for _ in 0..n {
                                let u = (rng(&mut seed) >> 11) as f64 / (1u64 << 53) as f64 * acc;
                                let word = u64::from(zipf_word(cdf, u));
                                let idx = (word.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as usize
                                    % vocab;
                                c[idx] += 1;
                            }
                            c
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_default())
                    .collect()
            });
            let map_secs = t.elapsed().as_secs_f64();
            let wl = VecWorkload::new(&counts);
            let runs = compare(
                &h,
                &[Mode::Kernel, Mode::Plain],
                reps,
                &mut round,
                &wl,
                |_| {
                    let total: i64 = wl.result().iter().map(|&x| x as i64).sum();
                    total as f64
                },
            )?;
            for (mode, rs) in runs {
                for (r, total) in &rs {
                    if *total as u64 != words {
                        bail!(
                            "word count: {} counted {total} words, {words} sent",
                            mode.name()
                        );
                    }
                    let _ = r;
                }
                let agg: Vec<f64> = rs.iter().map(|(r, _)| r.secs).collect();
                let wps: Vec<f64> = agg.iter().map(|a| words as f64 / (map_secs + a)).collect();
                for i in 0..rs.len() {
                    csv.row(vec![
                        mode.name().into(),
                        m.to_string(),
                        words.to_string(),
                        i.to_string(),
                        format!("{map_secs:.4}"),
                        format!("{:.6}", agg[i]),
                        format!("{:.0}", wps[i]),
                    ]);
                }
                progress(format!("wordcount {m} mappers {words} words {}: {} words/s (map {:.3} s + aggregate {:.4} s)", mode.name(), thousands(summarize(&wps).median), map_secs, summarize(&agg).median));
                points.push(WcPoint {
                    mode: mode.name().into(),
                    group: format!("{}M words", words / 1_000_000),
                    mappers: m,
                    words,
                    words_per_s: summarize(&wps),
                    map_secs,
                    agg_secs: summarize(&agg),
                });
            }

            // The paper-style baseline: the same words (same seeds, drawn
            // again outside the timed part) shipped as (word, 1) records.
            let lists: Vec<Vec<u32>> = (0..m)
                .map(|i| {
                    let mut seed = 0x1234_5678u64 + i as u64 * 7919;
                    let n = words / m as u64 + u64::from((i as u64) < words % m as u64);
                    (0..n)
                        .map(|_| zipf_word(&cdf, (rng(&mut seed) >> 11) as f64 / (1u64 << 53) as f64 * acc))
                        .collect()
                })
                .collect();
            let mut want: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
            for w in lists.iter().flatten() {
                *want.entry(*w).or_default() += 1;
            }
            let mut shuffle = Vec::new();
            for rep in 0..reps {
                let (secs, got) = records_reduce(&h, &lists)?;
                if got != want {
                    bail!("word count records baseline: the reducer's counts differ from the words sent");
                }
                let wps = words as f64 / (map_secs + secs);
                csv.row(vec![
                    "records".into(),
                    m.to_string(),
                    words.to_string(),
                    rep.to_string(),
                    format!("{map_secs:.4}"),
                    format!("{secs:.6}"),
                    format!("{wps:.0}"),
                ]);
                shuffle.push(secs);
            }
            let wps: Vec<f64> = shuffle.iter().map(|a| words as f64 / (map_secs + a)).collect();
            progress(format!(
                "wordcount {m} mappers {words} words records (TCP, hash map): {} words/s (map {:.3} s + shuffle/reduce {:.4} s)",
                thousands(summarize(&wps).median),
                map_secs,
                summarize(&shuffle).median
            ));
            points.push(WcPoint {
                mode: "records".into(),
                group: format!("{}M words", words / 1_000_000),
                mappers: m,
                words,
                words_per_s: summarize(&wps),
                map_secs,
                agg_secs: summarize(&shuffle),
            });
        }
    }
    csv.write(&opts.out_dir.join("wordcount.csv"))?;
    crate::write_json(&opts.out_dir.join("wordcount.json"), &points)?;
    let mut md = String::new();
    let _ = writeln!(md, "## 6. MapReduce word count\n");
    let _ = writeln!(
        md,
        "Mappers draw words from a Zipf(1) distribution over {} words, count them into a {}-entry vector by hashing the word, and the \
         vectors are SUM-reduced (AggBox XDP vs the plain UDP aggregator; the total count is checked). words/s = words / (map time + aggregation time). \
         Median over {reps} runs.\n",
        thousands(vocab as f64),
        thousands(vocab as f64),
    );
    let _ = writeln!(
        md,
        "Second baseline, the paper's kind: MapReduce without a combiner, every mapper streams one (word, 1) record of 8 bytes per word over TCP \
         to a user-space reducer that counts them in a hash map (one reader thread per mapper; the counts per word are checked against the words \
         sent). Its words/s = words / (the same map time + shuffle and reduce time).\n"
    );
    let _ = writeln!(md, "| mappers | words | AggBox words/s | baseline words/s | records baseline words/s | AggBox agg. ms | baseline agg. ms | records shuffle+reduce ms | map s |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for &m in &mappers {
        for &words in &words_list {
            let k = points
                .iter()
                .find(|p| p.mode == "kernel" && p.mappers == m && p.words == words);
            let b = points
                .iter()
                .find(|p| p.mode == "plain" && p.mappers == m && p.words == words);
            let rec = points
                .iter()
                .find(|p| p.mode == "records" && p.mappers == m && p.words == words);
            if let (Some(k), Some(b), Some(rec)) = (k, b, rec) {
                let _ = writeln!(
                    md,
                    "| {m} | {} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.3} |",
                    thousands(words as f64),
                    thousands(k.words_per_s.median),
                    thousands(b.words_per_s.median),
                    thousands(rec.words_per_s.median),
                    1e3 * k.agg_secs.median,
                    1e3 * b.agg_secs.median,
                    1e3 * rec.agg_secs.median,
                    k.map_secs
                );
            }
        }
    }
    let vector_points = || points.iter().filter(|p| p.mode == "kernel" || p.mode == "plain");
    let max_agg_ms = vector_points().map(|p| 1e3 * p.agg_secs.median).fold(f64::NEG_INFINITY, f64::max);
    let map_s = |f: fn(f64, f64) -> f64, init: f64| vector_points().map(|p| p.map_secs).fold(init, f);
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let _ = writeln!(
        md,
        "\n**Paper (Fig. 10; quoted):** 126.25 M vs 5.72 M words/s (2 mappers, 4 M words, 22×); 257.66 M vs 5.98 M (10 mappers, 10 M words, 43×). \
         **Here (measured, table above):** both sides ship the same count vectors ({} datagrams per mapper at MTU 1500): the aggregation took at \
         most {max_agg_ms:.1} ms in either, the map phase (drawing and hashing the words, on this VM's {cpus} shared vCPUs) {:.3}–{:.3} s. \
         Our reading (not measured): the paper's baseline shipped far more data per word (its 5.7 M words/s is near a per-word datagram rate), \
         which is what the records baseline reproduces; against it AggBox's gain is of the paper's kind, and it comes from the combiner-and-vector \
         design as much as from the kernel. Plot: `wordcount.png`.\n",
        vocab.div_ceil(crate::agg::PER),
        map_s(f64::min, f64::INFINITY),
        map_s(f64::max, f64::NEG_INFINITY),
    );
    Ok(Section {
        name: "wordcount".into(),
        markdown: md,
        headline: vec![],
    })
}
