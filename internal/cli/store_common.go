package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
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
func (g *Globals) dial() (*client.Client, error) { return g.dialCtx(g.Context()) }

// dialCtx is dial bounded by ctx (a command's --timeout).
func (g *Globals) dialCtx(ctx context.Context) (*client.Client, error) {
	sock := g.socketPath()
	c, err := client.Dial(ctx, sock)
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
	case isDial && errors.Is(err, client.ErrTimeout):
		return fmt.Errorf("the store daemon at %s did not answer in time: check that 'cudaipc serve' is running and not stopped or overloaded, then retry (%w)", socket, err)
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
