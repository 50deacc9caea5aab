package store

import (
	"context"
	"log/slog"
	"sync"
	"syscall"
	"time"
)

// logLimiter allows bursts of log lines of one kind, then one per period:
// a token bucket. The lines it holds back are counted and reported with
// the next one let through.
type logLimiter struct {
	burst int
	every time.Duration

	mu         sync.Mutex
	tokens     float64
	last       time.Time
	started    bool
	suppressed int
}

// allow reports whether a line may be logged now and, if so, how many were
// held back since the last one.
func (l *logLimiter) allow() (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if !l.started {
		l.started, l.tokens, l.last = true, float64(l.burst), now
	}
	l.tokens = min(float64(l.burst), l.tokens+float64(now.Sub(l.last))/float64(l.every))
	l.last = now
	if l.tokens < 1 {
		l.suppressed++
		return false, 0
	}
	l.tokens--
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}

// defaultMaxConns is DefaultMaxConns, lowered to leave half of the
// process's descriptors to arenas, the log and the listener.
func defaultMaxConns() int {
	n := rlimitNoFile()
	if n >= 2*DefaultMaxConns {
		return DefaultMaxConns
	}
	return max(16, int(n/2))
}

// rlimitNoFile returns the process's descriptor limit (the soft one, which
// Go raises to the hard one at start).
func rlimitNoFile() uint64 {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 1024
	}
	return rl.Cur
}

// Every log line above debug level that an admitted client can cause goes
// through its uid's limiter (Store.logFor): a client that floods the
// daemon with bad packets, registrations or doomed connections costs the
// log a burst, then one line per clientLogEvery, with the count held
// back, whatever it sends. Debug lines, off by default, are not limited.
const (
	clientLogBurst = 20
	clientLogEvery = time.Second
)

// limitedHandler passes records of level Info and above through a shared
// limiter, adding how many were held back before each one let through.
type limitedHandler struct {
	inner slog.Handler
	lim   *logLimiter
}

func (h limitedHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.inner.Enabled(ctx, l)
}

func (h limitedHandler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo {
		return h.inner.Handle(ctx, r)
	}
	ok, suppressed := h.lim.allow()
	if !ok {
		return nil
	}
	if suppressed > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("suppressed", suppressed))
	}
	return h.inner.Handle(ctx, r)
}

func (h limitedHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return limitedHandler{h.inner.WithAttrs(as), h.lim}
}

func (h limitedHandler) WithGroup(name string) slog.Handler {
	return limitedHandler{h.inner.WithGroup(name), h.lim}
}

// logFor returns the logger for lines that uid's requests cause: the
// store's, rate-limited per uid. Uids are only those the store admits, so
// the loggers kept are bounded by its configuration.
func (s *Store) logFor(uid uint32) *slog.Logger {
	s.logsMu.Lock()
	defer s.logsMu.Unlock()
	l := s.clientLogs[uid]
	if l == nil {
		l = slog.New(limitedHandler{s.log.Handler(), &logLimiter{burst: clientLogBurst, every: clientLogEvery}})
		s.clientLogs[uid] = l
	}
	return l
}
