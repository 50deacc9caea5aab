package cli

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/schollz/progressbar/v3"
)

// socketPath is the daemon socket the store commands use: --socket, else
// $CUDAIPC_SOCKET (both filled in by kong), else the per-user default.
func (g *Globals) socketPath() string {
	if g.Socket != "" {
		return g.Socket
	}
	return client.DefaultSocketPath()
}

// dial connects to the store daemon, with an error that says what to do
// when there is none.
func (g *Globals) dial() (*client.Client, error) {
	sock := g.socketPath()
	c, err := client.Dial(g.Context(), sock)
	if err != nil {
		return nil, explain(err, sock)
	}
	return c, nil
}

// explain turns a client error into one that tells the user what to do next.
func explain(err error, socket string) error {
	var ce *client.Error
	isDial := errors.As(err, &ce) && ce.Op == "dial"
	switch {
	case isDial && errors.Is(err, client.ErrStoreGone):
		return fmt.Errorf("no store daemon at %s: start one with 'cudaipc serve', or point --socket (or CUDAIPC_SOCKET) at a running one (%w)", socket, err)
	case isDial && errors.Is(err, client.ErrPermission):
		uid := os.Getuid()
		return fmt.Errorf("the store daemon at %s does not admit uid %d: ask whoever runs it to add '--allow-uid %d' (or --allow-gid) to 'cudaipc serve' (%w)", socket, uid, uid, err)
	case isDial && errors.Is(err, client.ErrVersion):
		return fmt.Errorf("the store daemon at %s speaks another protocol version: run a cudaipc of the same release as the daemon (%w)", socket, err)
	case errors.Is(err, client.ErrStoreGone):
		return fmt.Errorf("lost the connection to the store daemon at %s: check that 'cudaipc serve' is still running, then retry (%w)", socket, err)
	case errors.Is(err, client.ErrNotFound):
		return fmt.Errorf("%w (see 'cudaipc ls' for the objects you can read)", err)
	case errors.Is(err, client.ErrExists):
		return fmt.Errorf("%w (pick another --name, or remove the old one with 'cudaipc rm')", err)
	case errors.Is(err, client.ErrStoreFull):
		return fmt.Errorf("%w (free space with 'cudaipc rm', or restart 'cudaipc serve' with a larger --capacity)", err)
	case errors.Is(err, client.ErrLimit):
		return fmt.Errorf("%w (release leases or remove objects this client holds)", err)
	}
	return err
}

// byteSize is a flag value in bytes that accepts suffixes: 4096, 64KiB,
// 16MiB, 1GiB, 1G (powers of 1024 either way).
type byteSize int64

func (b *byteSize) UnmarshalText(text []byte) error {
	n, err := parseSize(string(text))
	if err != nil {
		return err
	}
	*b = byteSize(n)
	return nil
}

func (b byteSize) String() string { return humanBytes(int64(b)) }

func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	lower := strings.ToLower(t)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{
		{"tib", 1 << 40}, {"gib", 1 << 30}, {"mib", 1 << 20}, {"kib", 1 << 10},
		{"tb", 1 << 40}, {"gb", 1 << 30}, {"mb", 1 << 20}, {"kb", 1 << 10},
		{"t", 1 << 40}, {"g", 1 << 30}, {"m", 1 << 20}, {"k", 1 << 10}, {"b", 1},
	} {
		if strings.HasSuffix(lower, u.suffix) {
			mult = u.mult
			t = strings.TrimSpace(t[:len(t)-len(u.suffix)])
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q: want a byte count such as 4096, 64KiB, 16MiB or 1GiB", s)
	}
	if n > (1<<62)/mult {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n * mult, nil
}

// humanBytes prints n in IEC units: 4.0 KiB, 64.0 MiB.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 4; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTP"[exp])
}

// newProgress returns a byte progress bar on w when w is a terminal, else
// nil (callers use progressAdd, which accepts nil).
func newProgress(w io.Writer, total int64, what string) *progressbar.ProgressBar {
	if !isTerminal(w) || total <= 0 {
		return nil
	}
	return progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowBytes(true),
		progressbar.OptionUseIECUnits(true),
		progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(65*time.Millisecond),
		progressbar.OptionClearOnFinish(),
	)
}

func progressAdd(b *progressbar.ProgressBar, n int) {
	if b != nil {
		_ = b.Add(n)
	}
}

func progressDone(b *progressbar.ProgressBar) {
	if b != nil {
		_ = b.Finish()
	}
}

// copyChunk is how much put and get move between progress updates.
const copyChunk = 4 << 20
