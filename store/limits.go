package store

import (
	"log/slog"
	"syscall"
	"time"

	"github.com/cudaipc/cudaipc/internal/loglimit"
)

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

// logFor returns the logger for lines that uid's requests cause: the
// store's, rate-limited per uid. Uids are only those the store admits, so
// the loggers kept are bounded by its configuration.
func (s *Store) logFor(uid uint32) *slog.Logger {
	s.logsMu.Lock()
	defer s.logsMu.Unlock()
	l := s.clientLogs[uid]
	if l == nil {
		l = slog.New(loglimit.NewHandler(s.log.Handler(), &loglimit.Limiter{Burst: clientLogBurst, Every: clientLogEvery}))
		s.clientLogs[uid] = l
	}
	return l
}
