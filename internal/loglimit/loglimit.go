// Package loglimit bounds the log lines that peers of the daemon can
// cause, whatever they send: a token bucket of lines (Limiter), a
// slog.Handler that passes records through one (Handler), and a tally of
// refused connections that logs the first ones in full and the rest as
// periodic summaries (Refusals).
package loglimit

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"
)

// Limiter allows bursts of log lines of one kind, then one per period:
// a token bucket. The lines it holds back are counted and reported with
// the next one let through. The zero Limiter allows nothing; set Burst
// and Every before first use. It is safe for concurrent use.
type Limiter struct {
	// Burst is how many lines may go at once; Every how often the
	// bucket gains one more.
	Burst int
	Every time.Duration

	mu         sync.Mutex
	tokens     float64
	last       time.Time
	started    bool
	suppressed int
}

// refill brings the bucket up to now; l.mu is held.
func (l *Limiter) refill(now time.Time) {
	if !l.started {
		l.started, l.tokens, l.last = true, float64(l.Burst), now
	}
	if l.Every > 0 {
		l.tokens = min(float64(l.Burst), l.tokens+float64(now.Sub(l.last))/float64(l.Every))
	}
	l.last = now
}

// Allow reports whether a line may be logged now and, if so, how many were
// held back since the last one.
func (l *Limiter) Allow() (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.refill(time.Now())
	if l.tokens < 1 {
		l.suppressed++
		return false, 0
	}
	l.tokens--
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}

// Next is how long until Allow would let a line through.
func (l *Limiter) Next() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.refill(time.Now())
	if l.tokens >= 1 {
		return 0
	}
	return time.Duration((1 - l.tokens) * float64(l.Every))
}

// Handler passes records of level Info and above through a shared
// Limiter, adding how many were held back ("suppressed") to each one let
// through. Debug records, off by default, are not limited.
type Handler struct {
	inner slog.Handler
	lim   *Limiter
}

// NewHandler returns a Handler writing to inner through lim.
func NewHandler(inner slog.Handler, lim *Limiter) Handler { return Handler{inner, lim} }

// Enabled reports whether the inner handler takes records of level l.
func (h Handler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

// Handle passes r on when the limiter allows (or r is below Info).
func (h Handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo {
		return h.inner.Handle(ctx, r)
	}
	ok, suppressed := h.lim.Allow()
	if !ok {
		return nil
	}
	if suppressed > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", suppressed))
	}
	return h.inner.Handle(ctx, r)
}

// WithAttrs returns a Handler with attributes, sharing the limiter.
func (h Handler) WithAttrs(as []slog.Attr) slog.Handler {
	return Handler{h.inner.WithAttrs(as), h.lim}
}

// WithGroup returns a Handler with a group, sharing the limiter.
func (h Handler) WithGroup(name string) slog.Handler {
	return Handler{h.inner.WithGroup(name), h.lim}
}

// maxSources bounds the source addresses a Refusals tells apart between
// two summaries; the others count as one.
const maxSources = 256

// Refusals logs the connections a listener refuses at Warn level through
// a Limiter: while the limiter allows, each refusal gets a line of its own
// (its message, reason, source and details); beyond, they are only
// counted, and one summary line per period, when the limiter next allows,
// gives how many were refused, by reason, and the source address that
// caused most. However many connections are refused, the log gets at most
// Burst lines, then one per Every. It is safe for concurrent use; Close
// writes the summary still pending.
type Refusals struct {
	log     *slog.Logger
	summary string
	lim     Limiter

	mu       sync.Mutex
	pending  int
	since    time.Time
	byReason map[string]int
	bySource map[string]int
	timer    *time.Timer
	closed   bool
}

// NewRefusals returns a Refusals logging to log (nil: discard), whose
// summaries say summary, letting burst lines through at once and then
// one per every.
func NewRefusals(log *slog.Logger, summary string, burst int, every time.Duration) *Refusals {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Refusals{log: log, summary: summary, lim: Limiter{Burst: burst, Every: every},
		byReason: map[string]int{}, bySource: map[string]int{}}
}

// Refuse records a refused connection from source for reason; msg and
// args describe it when it gets a line of its own.
func (r *Refusals) Refuse(reason, source, msg string, args ...any) {
	r.mu.Lock()
	if r.pending == 0 && !r.closed {
		if ok, _ := r.lim.Allow(); ok {
			r.mu.Unlock()
			r.log.Warn(msg, append([]any{"reason", reason, "source", source}, args...)...)
			return
		}
		r.since = time.Now()
		r.timer = time.AfterFunc(r.lim.Next(), r.flush)
	}
	r.pending++
	r.byReason[reason]++
	if _, ok := r.bySource[source]; ok || len(r.bySource) < maxSources {
		r.bySource[source]++
	} else {
		r.bySource["other"]++
	}
	r.mu.Unlock()
}

// flush writes the pending summary when the limiter allows, or waits
// until it does.
func (r *Refusals) flush() {
	r.mu.Lock()
	if r.pending == 0 {
		r.mu.Unlock()
		return
	}
	if !r.closed {
		if ok, _ := r.lim.Allow(); !ok {
			r.timer = time.AfterFunc(r.lim.Next(), r.flush)
			r.mu.Unlock()
			return
		}
	}
	args := r.takeSummaryLocked()
	r.mu.Unlock()
	r.log.Warn(r.summary, args...)
}

// takeSummaryLocked returns the summary's attributes and starts a new one.
func (r *Refusals) takeSummaryLocked() []any {
	reasons := slices.Sorted(maps.Keys(r.byReason))
	var b strings.Builder
	for i, k := range reasons {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s=%d", k, r.byReason[k])
	}
	var top string
	for s, n := range r.bySource {
		if top == "" || cmp.Or(cmp.Compare(n, r.bySource[top]), strings.Compare(top, s)) > 0 {
			top = s
		}
	}
	args := []any{"refused", r.pending, "reasons", b.String(), "top_source", top, "top_source_refused", r.bySource[top],
		"over", time.Since(r.since).Round(time.Millisecond)}
	r.pending = 0
	clear(r.byReason)
	clear(r.bySource)
	return args
}

// Close writes the summary still pending, if any; later refusals are
// counted into summaries written only by another Close.
func (r *Refusals) Close() {
	r.mu.Lock()
	r.closed = true
	if r.timer != nil {
		r.timer.Stop()
	}
	r.mu.Unlock()
	r.flush()
}
