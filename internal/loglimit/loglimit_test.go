package loglimit

import (
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

func lines(b *testutil.SyncBuffer) []string {
	s := strings.TrimSpace(b.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// TestRefusalsBurstThenSummary: a thousand refusals from two sources for
// two reasons cost the log the burst, each in full, and then one summary
// line, written by Close, that counts the rest by reason and names the
// source that caused most.
func TestRefusalsBurstThenSummary(t *testing.T) {
	var buf testutil.SyncBuffer
	r := NewRefusals(slog.New(slog.NewTextHandler(&buf, nil)), "refused connections", 3, time.Hour)
	for i := range 1000 {
		src, reason := "10.0.0.1", "closed"
		if i%4 == 0 {
			src, reason = "10.0.0.2", "timeout"
		}
		r.Refuse(reason, src, "refused a connection", "n", i)
	}
	if l := lines(&buf); len(l) != 3 || !strings.Contains(l[0], "reason=timeout source=10.0.0.2 n=0") {
		t.Fatalf("before the summary: %d lines, want the burst of 3:\n%s", len(l), buf.String())
	}
	r.Close()
	l := lines(&buf)
	if len(l) != 4 {
		t.Fatalf("%d lines after Close, want 4:\n%s", len(l), buf.String())
	}
	for _, want := range []string{`msg="refused connections"`, "refused=997", `reasons="closed=748 timeout=249"`, "top_source=10.0.0.1", "top_source_refused=748"} {
		if !strings.Contains(l[3], want) {
			t.Fatalf("summary %q lacks %q", l[3], want)
		}
	}
	r.Close()
	if n := len(lines(&buf)); n != 4 {
		t.Fatalf("a second Close wrote %d lines more", n-4)
	}
}

// TestRefusalsPeriodicSummary: past the burst, refusals are summed into
// lines the limiter's period lets through, without a Close; every refusal
// is counted in exactly one line, and the sources told apart are bounded.
func TestRefusalsPeriodicSummary(t *testing.T) {
	var buf testutil.SyncBuffer
	r := NewRefusals(slog.New(slog.NewTextHandler(&buf, nil)), "refused connections", 1, 20*time.Millisecond)
	const n = 2000
	for i := range n {
		r.Refuse("closed", fmt.Sprintf("10.0.%d.%d", i/256, i%256), "refused a connection")
	}
	counted := regexp.MustCompile(` refused=(\d+) `)
	total := func() (int, error) {
		sum := 0
		for _, l := range lines(&buf) {
			if m := counted.FindStringSubmatch(l); m != nil {
				v, _ := strconv.Atoi(m[1])
				sum += v
				if !strings.Contains(l, "top_source=") {
					return 0, fmt.Errorf("summary without its top source: %s", l)
				}
			} else {
				sum++
			}
		}
		return sum, nil
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		sum, err := total()
		if err != nil {
			t.Fatal(err)
		}
		if sum != n {
			return fmt.Errorf("%d refusals in the log, want %d", sum, n)
		}
		return nil
	})
	if len(r.bySource) != 0 {
		t.Fatalf("%d sources kept after the summary", len(r.bySource))
	}
	r.Close()
	if sum, _ := total(); sum != n {
		t.Fatalf("%d refusals in the log after Close, want %d", sum, n)
	}
}

// TestLimiterNext: Next says when Allow lets the next line through.
func TestLimiterNext(t *testing.T) {
	l := Limiter{Burst: 1, Every: time.Hour}
	if ok, _ := l.Allow(); !ok || l.Next() < 59*time.Minute {
		t.Fatalf("after the burst: next line in %v, want about an hour", l.Next())
	}
	if ok, _ := l.Allow(); ok {
		t.Fatal("a second line allowed within the hour")
	}
}
