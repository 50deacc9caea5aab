package cli

import (
	"bytes"
	"fmt"
	"io"
	"os"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

type putCmd struct {
	File   string `arg:"" help:"File to store, or - for standard input." placeholder:"FILE|-"`
	Name   string `required:"" help:"Name of the new object." placeholder:"NAME"`
	Device string `default:"host" help:"Where the object's memory lives: host, a GPU ordinal (of this process, resolved to its UUID) or a GPU UUID; GPUs need a daemon with the cuda backend." placeholder:"host|ORDINAL|UUID"`
	Shared bool   `help:"Let every user the daemon admits read the object (default: only your uid)."`
}

func (c *putCmd) Help() string {
	return "Copies FILE into a new object NAME and seals it, so that readers can 'cudaipc get' it. A progress bar shows on a terminal."
}

func (c *putCmd) Run(g *Globals) error {
	src, size, err := openInput(c.File, g)
	if err != nil {
		return err
	}
	defer src.Close()

	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()

	ctx := g.Context()
	obj, err := cl.Create(ctx, c.Name, size, client.CreateOptions{Device: c.Device, Shared: c.Shared})
	if err != nil {
		return explain(err, g.socketPath())
	}
	if err := fill(obj, size, src, g, c.Name); err != nil {
		_ = obj.Abort(ctx)
		return fmt.Errorf("reading %s: %w (nothing was stored)", c.File, err)
	}
	if err := obj.Seal(ctx); err != nil {
		return explain(err, g.socketPath())
	}
	fmt.Fprintf(g.stdout, "stored %q: %s (%d bytes) on %s\n", c.Name, bytesize.Format(size), size, obj.Device())
	return nil
}

// openInput opens FILE or standard input and returns its size. A pipe is
// read into memory first, since an object's size is fixed at creation.
func openInput(name string, g *Globals) (io.ReadCloser, int64, error) {
	f, ok := g.stdin.(*os.File)
	if name == "-" && !ok {
		data, err := io.ReadAll(g.stdin)
		return io.NopCloser(bytes.NewReader(data)), int64(len(data)), err
	}
	if name != "-" {
		var err error
		if f, err = os.Open(name); err != nil {
			return nil, 0, err
		}
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	if st.Mode().IsRegular() {
		if name == "-" {
			return io.NopCloser(f), st.Size(), nil // never close our stdin
		}
		return f, st.Size(), nil
	}
	if st.IsDir() {
		f.Close()
		return nil, 0, fmt.Errorf("%s is a directory: put stores one file", name)
	}
	data, err := io.ReadAll(f)
	if name != "-" {
		f.Close()
	}
	if err != nil {
		return nil, 0, err
	}
	return io.NopCloser(bytes.NewReader(data)), int64(len(data)), nil
}

// fill reads exactly size bytes from src into obj, showing progress on a
// terminal. Host objects are filled in place; GPU objects through a host
// buffer, one chunk at a time.
func fill(obj *client.Object, size int64, src io.Reader, g *Globals, name string) error {
	bar := newProgress(g.stderr, size, "put "+name)
	defer progressDone(bar)
	dst := obj.Bytes()
	var buf []byte
	if dst == nil {
		buf = make([]byte, min(int64(copyChunk), size))
	}
	for off := int64(0); off < size; {
		end := min(off+copyChunk, size)
		var chunk []byte
		if dst != nil {
			chunk = dst[off:end]
		} else {
			chunk = buf[:end-off]
		}
		n, err := io.ReadFull(src, chunk)
		progressAdd(bar, n)
		if err == io.ErrUnexpectedEOF || err == io.EOF {
			return fmt.Errorf("input shrank while reading: got %d of %d bytes", off+int64(n), size)
		}
		if err != nil {
			return err
		}
		if dst == nil {
			if _, err := obj.WriteAt(chunk, off); err != nil {
				return err
			}
		}
		off = end
	}
	return nil
}
