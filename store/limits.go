package store

import (
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
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur >= 2*DefaultMaxConns {
		return DefaultMaxConns
	}
	return max(16, int(rl.Cur/2))
}
