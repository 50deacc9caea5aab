package ucxtransport

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// MaxLanes bounds Options.Lanes, and the lanes a peer's address may name.
const MaxLanes = 16

// The address of a node of several lanes: magicLanes (4), the number of
// lanes (1), then each lane's worker address envelope (ucx.WorkerAddress's
// binary encoding, which carries its own checksum) after its length (4,
// little-endian). A node of one lane publishes its worker address envelope
// alone, as nodes did before lanes.
var magicLanes = [4]byte{'u', 'c', 'L', 'N'}

// marshalLanes encodes the lanes' worker addresses.
func marshalLanes(addrs []ucx.WorkerAddress) ([]byte, error) {
	if len(addrs) == 1 {
		return addrs[0].MarshalBinary()
	}
	b := append(magicLanes[:len(magicLanes):len(magicLanes)], byte(len(addrs)))
	for _, a := range addrs {
		env, err := a.MarshalBinary()
		if err != nil {
			return nil, err
		}
		b = binary.LittleEndian.AppendUint32(b, uint32(len(env)))
		b = append(b, env...)
	}
	return b, nil
}

// unmarshalLanes decodes and checks what marshalLanes made: a worker
// address envelope, or the addresses of 2 to MaxLanes lanes. Anything else
// is an error matching ucx.ErrMalformed.
func unmarshalLanes(b []byte) ([]ucx.WorkerAddress, error) {
	if !bytes.HasPrefix(b, magicLanes[:]) {
		var a ucx.WorkerAddress
		if err := a.UnmarshalBinary(b); err != nil {
			return nil, err
		}
		return []ucx.WorkerAddress{a}, nil
	}
	bad := func(format string, args ...any) error {
		return &ucx.MalformedError{What: "worker address", Reason: "lanes: " + fmt.Sprintf(format, args...)}
	}
	b = b[len(magicLanes):]
	if len(b) < 1 {
		return nil, bad("no count")
	}
	n := int(b[0])
	if n < 2 || n > MaxLanes {
		return nil, bad("%d lanes, want 2 to %d", n, MaxLanes)
	}
	b = b[1:]
	addrs := make([]ucx.WorkerAddress, n)
	for i := range addrs {
		if len(b) < 4 {
			return nil, bad("lane %d: truncated", i)
		}
		l := binary.LittleEndian.Uint32(b)
		b = b[4:]
		if uint64(l) > uint64(len(b)) {
			return nil, bad("lane %d: %d bytes, %d left", i, l, len(b))
		}
		if err := addrs[i].UnmarshalBinary(b[:l]); err != nil {
			return nil, err
		}
		b = b[l:]
	}
	if len(b) != 0 {
		return nil, bad("%d bytes after the last lane", len(b))
	}
	return addrs, nil
}
