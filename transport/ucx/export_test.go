package ucx

// LeakedContexts is how many Contexts the cleanup backstop released.
func LeakedContexts() int64 { return leakedContexts.Load() }

// MakeWorkerAddress is a WorkerAddress of raw bytes b, as UCX 1.16 made.
func MakeWorkerAddress(b []byte) WorkerAddress { return WorkerAddress{ucxMajor: 1, ucxMinor: 16, b: b} }

// MakeFetchRequest encodes a fetch request.
func MakeFetchRequest(replyTag, addr, n uint64, token Token, reader WorkerAddress) []byte {
	return fetchRequest{replyTag: replyTag, addr: addr, n: n, token: token, reader: reader}.marshal()
}

// ParseFetchRequest decodes b as a fetch request and re-encodes it.
func ParseFetchRequest(b []byte) ([]byte, error) {
	r, err := parseFetchRequest(b)
	if err != nil {
		return nil, err
	}
	return r.marshal(), nil
}
