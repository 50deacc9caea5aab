package ucxtransport

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// MaxLanes bounds Options.Lanes, and the lanes a peer's address may name.
const MaxLanes = 16

// The address of a node: magicFetch (4), flags (1: flagGet when its
// serving workers also answer GETs), the number of lanes (1, 1 to
// MaxLanes), then each lane's worker address envelope (ucx.WorkerAddress's
// binary encoding, which carries its own checksum) after its length (4,
// little-endian). magicFetch says that the node's serving workers answer
// ucx.Fetch. Nodes of earlier versions published, and are read with GETs
// at, magicLanes and the same layout without the flags (2 lanes or more),
// or a worker address envelope alone (one lane).
var (
	magicFetch = [4]byte{'u', 'c', 'F', 'T'}
	magicLanes = [4]byte{'u', 'c', 'L', 'N'}
)

// flagGet: the node's serving workers answer GETs (it runs with ReadGet).
const flagGet = 1

// peerAddress is a node's decoded address.
type peerAddress struct {
	lanes []ucx.WorkerAddress
	// fetch: the node answers ucx.Fetch (magicFetch).
	fetch bool
	// get: the node answers GETs (flagGet, and every node of an earlier
	// version).
	get bool
}

// marshal encodes a.
func (a peerAddress) marshal() ([]byte, error) {
	if !a.fetch && len(a.lanes) == 1 {
		return a.lanes[0].MarshalBinary()
	}
	var b []byte
	if a.fetch {
		flags := byte(0)
		if a.get {
			flags |= flagGet
		}
		b = append(magicFetch[:len(magicFetch):len(magicFetch)], flags, byte(len(a.lanes)))
	} else {
		b = append(magicLanes[:len(magicLanes):len(magicLanes)], byte(len(a.lanes)))
	}
	for _, l := range a.lanes {
		env, err := l.MarshalBinary()
		if err != nil {
			return nil, err
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(env)))
		b = append(b, env...)
	}
	return b, nil
}

// parsePeerAddress decodes and checks what marshal made: a worker address
// envelope, the addresses of 2 to MaxLanes lanes (magicLanes), or of 1 to
// MaxLanes (magicFetch). Anything else is an error matching
// ucx.ErrMalformed.
func parsePeerAddress(b []byte) (peerAddress, error) {
	fetch := bytes.HasPrefix(b, magicFetch[:])
	if !fetch && !bytes.HasPrefix(b, magicLanes[:]) {
		var a ucx.WorkerAddress
		if err := a.UnmarshalBinary(b); err != nil {
			return peerAddress{}, err
		}
		return peerAddress{lanes: []ucx.WorkerAddress{a}, get: true}, nil
	}
	bad := func(format string, args ...any) error {
		return &ucx.MalformedError{What: "worker address", Reason: "lanes: " + fmt.Sprintf(format, args...)}
	}
	b = b[len(magicLanes):]
	get := !fetch
	if fetch {
		if len(b) < 1 {
			return peerAddress{}, bad("no flags")
		}
		if b[0]&^flagGet != 0 {
			return peerAddress{}, bad("unknown flags %#x", b[0])
		}
		get, b = b[0]&flagGet != 0, b[1:]
	}
	if len(b) < 1 {
		return peerAddress{}, bad("no count")
	}
	n, least := int(b[0]), 2
	if fetch {
		least = 1
	}
	if n < least || n > MaxLanes {
		return peerAddress{}, bad("%d lanes, want %d to %d", n, least, MaxLanes)
	}
	b = b[1:]
	addrs := make([]ucx.WorkerAddress, n)
	for i := range addrs {
		if len(b) < 4 {
			return peerAddress{}, bad("lane %d: truncated", i)
		}
		l := binary.LittleEndian.Uint32(b)
		b = b[4:]
		if uint64(l) > uint64(len(b)) {
			return peerAddress{}, bad("lane %d: %d bytes, %d left", i, l, len(b))
		}
		if err := addrs[i].UnmarshalBinary(b[:l]); err != nil {
			return peerAddress{}, err
		}
		b = b[l:]
	}
	if len(b) != 0 {
		return peerAddress{}, bad("%d bytes after the last lane", len(b))
	}
	return peerAddress{lanes: addrs, fetch: fetch, get: get}, nil
}
