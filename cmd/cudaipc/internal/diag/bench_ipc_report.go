package diag

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/internal/bytesize"
)

// ipcStat is one measured quantity. Latencies are in µs; bandwidths in
// GB/s (1e9 bytes a second of bytes copied), where P99 is the bandwidth of
// the 99th-percentile (slow) repetition and so the lower number.
//
// The same JSON shape comes out of scripts/bench/ipc_bench.c and
// scripts/bench/torch_ipc.py, so scripts/bench/compare.py can put them side
// by side.
type ipcStat struct {
	Unit  string  `json:"unit"` // "us" or "GB/s"
	P50   float64 `json:"p50"`
	P99   float64 `json:"p99"`
	N     int     `json:"n"`
	Ratio float64 `json:"ratio,omitempty"` // bandwidth: P50 over Ref's P50
	Ref   string  `json:"ref,omitempty"`   // bandwidth: the in-process reference of this run
}

// ipcBenchReport is what 'cudaipc bench ipc --json' prints.
type ipcBenchReport struct {
	Tool    string             `json:"tool"`
	Device  string             `json:"device"`
	GPUs    int                `json:"gpus"`
	Size    int64              `json:"size"`
	Iters   int                `json:"iters"`
	BWIters int                `json:"bw_iters"`
	Staging string             `json:"staging,omitempty"`
	Metrics map[string]ipcStat `json:"metrics"`
	Notes   []string           `json:"notes,omitempty"`
}

// ipcMetric names a row of the report, in the order the table shows them.
type ipcMetric struct {
	Key, What string
}

// ipcMetrics lists every metric any of the benchmark programs reports;
// keys are shared with the C and Python programs.
var ipcMetrics = []ipcMetric{
	{"export_first", "cuIpcGetMemHandle, first on a fresh 1 MiB allocation"},
	{"export_again", "cuIpcGetMemHandle, allocation already exported"},
	{"open_cold_1mib", "cuIpcOpenMemHandle, 1 MiB, not open in this process"},
	{"close_1mib", "cuIpcCloseMemHandle that unmaps 1 MiB"},
	{"open_cold_large", "cuIpcOpenMemHandle, large allocation, not open"},
	{"close_large", "cuIpcCloseMemHandle that unmaps the large allocation"},
	{"open_already_open", "cuIpcOpenMemHandle of a handle already open here"},
	{"close_decrement", "cuIpcCloseMemHandle that only drops a reference"},
	{"event_open", "cuIpcOpenEventHandle"},
	{"open_cold_peer", "cuIpcOpenMemHandle of the other GPU's large allocation"},
	{"share_1mib", "send to usable tensor in the receiver, 1 MiB (PyTorch)"},
	{"share_1mib_again", "same, tensor in a segment the receiver has open"},
	{"share_large", "send to usable tensor in the receiver, large"},
	{"d2d_local", "device-to-device copy in one process (hardware reference)"},
	{"ipc_read", "same copy, reading another process's memory via IPC"},
	{"host_staged", "host-staged hand-over, end to end"},
	{"host_staged_dma", "host-staged, D2H + H2D copy time only"},
	{"peer_local", "GPU 1 -> GPU 0 copy in one process (NVLink reference)"},
	{"peer_ipc", "same, reading another process's GPU 1 memory via IPC"},
}

// rankIndex returns the index of the pct-th percentile in a sorted slice of
// n values by the nearest-rank method, ceil(pct/100*n)-1, in integers so
// that the C and Python programs pick the same element. Every percentile
// the diagnostics report is this one.
func rankIndex(n, pct int) int {
	i := (pct*n+99)/100 - 1
	return max(i, 0)
}

// percentile returns the pct-th percentile of sorted (nearest rank); 0 for
// none.
func percentile(sorted []time.Duration, pct int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[rankIndex(len(sorted), pct)]
}

// latencyStat summarizes durations as median and p99 in µs.
func latencyStat(d []time.Duration) ipcStat {
	if len(d) == 0 {
		return ipcStat{Unit: "us"}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return ipcStat{Unit: "us", P50: micros(percentile(s, 50)), P99: micros(percentile(s, 99)), N: len(s)}
}

// bandwidthStat turns the durations of copies of n bytes into GB/s: P50 of
// the median time, P99 of the 99th-percentile time.
func bandwidthStat(n int64, d []time.Duration) ipcStat {
	if len(d) == 0 {
		return ipcStat{Unit: "GB/s"}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	gbs := func(x time.Duration) float64 {
		if x <= 0 {
			return 0
		}
		return float64(n) / x.Seconds() / 1e9
	}
	return ipcStat{Unit: "GB/s", P50: gbs(percentile(s, 50)), P99: gbs(percentile(s, 99)), N: len(s)}
}

// micros is d in microseconds.
func micros(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// setRatios fills Ratio of every bandwidth metric that names a Ref present
// in the report.
func (r *ipcBenchReport) setRatios() {
	for k, m := range r.Metrics {
		ref, ok := r.Metrics[m.Ref]
		if m.Unit != "GB/s" || !ok || ref.P50 == 0 {
			continue
		}
		m.Ratio = m.P50 / ref.P50
		r.Metrics[k] = m
	}
}

// writeIPCTable prints the report as two aligned tables, latencies then
// bandwidths, in the order of ipcMetrics.
func writeIPCTable(w io.Writer, r *ipcBenchReport) error {
	fmt.Fprintf(w, "%s: %s, %d GPU(s), large = %s, %d repetitions a latency, %d a bandwidth\n\n",
		r.Tool, r.Device, r.GPUs, bytesize.Format(r.Size), r.Iters, r.BWIters)
	line := func(format string, cells ...any) {
		fmt.Fprintln(w, strings.TrimRight(fmt.Sprintf(format, cells...), " "))
	}
	const latRow, bwRow = "%-18s %10s %10s %5s  %s", "%-18s %10s %10s %5s  %-18s %s"
	line(latRow, "latency", "p50 µs", "p99 µs", "n", "")
	for _, m := range ipcMetrics {
		s, ok := r.Metrics[m.Key]
		if !ok || s.Unit != "us" {
			continue
		}
		line(latRow, m.Key, formatNum(s.P50), formatNum(s.P99), strconv.Itoa(s.N), m.What)
	}
	fmt.Fprintln(w)
	line(bwRow, "bandwidth", "p50 GB/s", "p99 GB/s", "n", "vs reference", "")
	for _, m := range ipcMetrics {
		s, ok := r.Metrics[m.Key]
		if !ok || s.Unit != "GB/s" {
			continue
		}
		ratio := "-"
		if s.Ref != "" && s.Ratio != 0 {
			ratio = fmt.Sprintf("%.3gx %s", s.Ratio, s.Ref)
		}
		line(bwRow, m.Key, formatNum(s.P50), formatNum(s.P99), strconv.Itoa(s.N), ratio, m.What)
	}
	if r.Staging != "" {
		fmt.Fprintf(w, "\nhost_staged: %s\n", r.Staging)
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
	return nil
}

// formatNum prints three significant digits, without exponents below 1e6.
func formatNum(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	case v >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.3f", v), "0"), ".")
	}
}
